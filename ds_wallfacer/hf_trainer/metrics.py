"""What ``WallfacerTrainer`` adds to each training log of the Trainer (and so to wandb, tensorboard, ...): target
tokens per second over all ranks, bytes this rank sent for sequence parallelism since the last log (by phase and
kind, ``CommLayer.sent``), and this rank's peak memory.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ..train.metrics import comm_bytes, peak_memory_bytes

__all__ = ["LogMetrics"]


class LogMetrics:
    """Counts between two training logs; ``collect`` returns the ``wallfacer/*`` values and starts the next span."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm
        self._tokens, self._since, self._sent_before = 0, time.perf_counter(), Counter(comm.sent)

    def restart(self) -> None:
        """Begin a new span now (counts so far dropped)."""
        self._tokens, self._since, self._sent_before = 0, time.perf_counter(), Counter(self._comm.sent)

    def add_tokens(self, n: int) -> None:
        """Targets of one optimizer step over every rank (each token counted once)."""
        self._tokens += int(n)

    def collect(self) -> dict[str, float]:
        now = time.perf_counter()
        sent = Counter(self._comm.sent)
        sent.subtract(self._sent_before)
        out: dict[str, float] = {"wallfacer/tokens_per_s": self._tokens / max(now - self._since, 1e-9),
                                 "wallfacer/peak_memory_bytes": float(peak_memory_bytes())}
        out.update({f"wallfacer/{k}": float(v) for k, v in comm_bytes(+sent).items()})
        self.restart()
        return out
