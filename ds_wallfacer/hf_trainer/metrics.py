"""What ``WallfacerTrainer`` adds to each training log of the Trainer (and so to wandb, tensorboard, ...): tokens
per second over all ranks (real tokens, padding left out; and the loss's targets alone), bytes this rank sent for
sequence parallelism since the last log (by phase and kind, ``CommLayer.sent``), and this rank's peak memory.
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
        self.restart()
        self.total_tokens = 0
        """Real tokens of every optimizer step so far, over all ranks (never restarted)."""

    def restart(self) -> None:
        """Begin a new span now (counts so far dropped)."""
        self._tokens, self._targets = 0, 0
        self._since, self._sent_before = time.perf_counter(), Counter(self._comm.sent)

    def add_tokens(self, tokens: int, targets: int) -> None:
        """One optimizer step over every rank (each token counted once): its real tokens and the loss's targets."""
        self._tokens += int(tokens)
        self._targets += int(targets)
        self.total_tokens += int(tokens)

    def collect(self) -> dict[str, float]:
        now = time.perf_counter()
        sent = Counter(self._comm.sent)
        sent.subtract(self._sent_before)
        span = max(now - self._since, 1e-9)
        out: dict[str, float] = {"wallfacer/tokens_per_s": self._tokens / span,
                                 "wallfacer/target_tokens_per_s": self._targets / span,
                                 "wallfacer/peak_memory_bytes": float(peak_memory_bytes())}
        out.update({f"wallfacer/{k}": float(v) for k, v in comm_bytes(+sent).items()})
        self.restart()
        return out
