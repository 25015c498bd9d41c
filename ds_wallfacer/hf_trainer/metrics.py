"""What ``WallfacerTrainer`` adds to each training log of the Trainer (and so to wandb, tensorboard, ...): tokens
per second over all ranks (real tokens, padding left out; and the loss's targets alone), bytes this rank sent for
sequence parallelism since the last log (by phase and kind, ``CommLayer.sent``), and this rank's peak memory.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any

from ..train.metrics import comm_bytes, peak_memory_bytes

__all__ = ["LogMetrics", "StepActivationBytes"]


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


class StepActivationBytes:
    """A ``TrainerCallback`` (``callback()``) that measures, during optimizer step ``step`` on this rank, the bytes of
    the tensors autograd saves for backward in one micro-step (the activations; distinct storages, parameters
    excluded), the largest micro-step's: the benchmarks' memory figure, the same on CPU and GPU
    (``torch.autograd.graph.saved_tensors_hooks``). On CUDA also the step's ``max_memory_allocated``.
    ``activation_bytes`` is None until measured. Not under ZeRO-3: a saved tensor comes back from the hooks as a
    plain tensor, and ZeRO-3's parameters, saved by some backward functions, need their own attributes there."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.activation_bytes: int | None = None
        self.cuda_peak_bytes: int | None = None
        self._hooks: Any = None
        self._seen: dict[tuple[Any, int], int] = {}

    def callback(self) -> Any:
        from transformers import TrainerCallback

        owner = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if state.global_step + 1 == owner.step:
                    owner.start()

            def on_substep_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if owner._hooks is not None:
                    owner.close_micro_step()

            def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
                if owner._hooks is not None:
                    owner.stop()

        return _Callback()

    def _pack(self, t: Any) -> Any:
        import torch

        if not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            storage = t.untyped_storage()
            self._seen[(t.device, storage.data_ptr())] = storage.nbytes()
        return t

    def start(self) -> None:
        import torch

        self._seen, self.activation_bytes = {}, 0
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()

    def close_micro_step(self) -> None:
        self.activation_bytes = max(self.activation_bytes or 0, sum(self._seen.values()))
        self._seen = {}

    def stop(self) -> None:
        import torch

        self.close_micro_step()
        self._hooks.__exit__(None, None, None)
        self._hooks = None
        if torch.cuda.is_available():
            self.cuda_peak_bytes = int(torch.cuda.max_memory_allocated())
