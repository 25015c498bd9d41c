"""Non-finite steps: a NaN or inf loss or gradient norm on any rank skips that step's update on every rank, is
logged, and ``--nonfinite_limit`` such steps in a row stop the job with the step, the data position and the ranks
named. Who skips (DeepSpeed's ZeRO optimizers, or ``UpdateGate`` in front of a plain optimizer): Note [Non-finite
steps] in docs/design/faults.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["NONFINITE_EXIT_CODE", "NonFiniteRun", "NonFiniteStop", "StepCheck", "UpdateGate", "check_step"]

NONFINITE_EXIT_CODE = 4
"""Exit status of a job stopped by non-finite steps."""


class NonFiniteStop(RuntimeError):
    """``--nonfinite_limit`` non-finite steps in a row, or a non-finite update that was applied: the job stops."""


@dataclass(frozen=True)
class StepCheck:
    """What one optimizer step's figures say (the same on every rank)."""

    bad_loss_ranks: tuple[int, ...]
    grad_norm_finite: bool
    applied: bool

    @property
    def finite(self) -> bool:
        return not self.bad_loss_ranks and self.grad_norm_finite

    def describe(self) -> str:
        """E.g. "loss nan on rank 1" or "gradient norm inf"."""
        parts = []
        if self.bad_loss_ranks:
            ranks = ", ".join(map(str, self.bad_loss_ranks[:8])) + (" ..." if len(self.bad_loss_ranks) > 8 else "")
            parts.append(f"non-finite loss on rank{'s' if len(self.bad_loss_ranks) > 1 else ''} {ranks}")
        if not self.grad_norm_finite:
            parts.append("non-finite gradient norm (all ranks' gradients together)")
        return " and ".join(parts) or "finite"


def check_step(losses: list[float], grad_norm: float | None, *, applied: bool, fp16: bool) -> StepCheck:
    """The check of a step from every rank's loss (index = rank), DeepSpeed's global gradient norm (None: not
    computed) and whether the update was applied. Under fp16 a step DeepSpeed skipped with a finite loss is its loss
    scaler's overflow, not a fault (pure)."""
    bad = tuple(r for r, x in enumerate(losses) if not math.isfinite(x))
    norm_ok = grad_norm is None or math.isfinite(grad_norm)
    if not applied and not bad and norm_ok and not fp16:
        norm_ok = False  # DeepSpeed skipped it for its own overflow check: the norm was not finite
    return StepCheck(bad, norm_ok, applied)


@dataclass
class NonFiniteRun:
    """Non-finite steps in a row, against ``limit`` (0: never stop)."""

    limit: int
    in_a_row: int = 0
    skipped: int = 0
    """Steps whose update was skipped, over the run."""

    def observe(self, check: StepCheck, *, step: int, epoch: int, seq_end: int, seq_per_step: int,
                last_ckpt: Any) -> None:
        """Count step ``step`` (``seq_end``: sequences of ``epoch`` consumed after it); ``NonFiniteStop`` after
        ``limit`` in a row, or at once for an applied non-finite update (nothing that skips stood in front of it)."""
        if check.finite:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        self.skipped += not check.applied
        first = step - self.in_a_row + 1
        steps = f"step {step}" if first == step else f"steps {first}-{step}"
        where = (f"{steps}: {check.describe()} (data: epoch {epoch}, sequences "
                 f"{seq_end - self.in_a_row * seq_per_step}-{seq_end - 1} of the epoch)")
        last = f"the last checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was saved"
        if check.applied:
            raise NonFiniteStop(f"{where}: the update was applied (DeepSpeed's overflow check is off, e.g. bf16 "
                                f"check_grad_overflow: false), so the weights are no longer finite: stopping; {last}")
        if self.limit and self.in_a_row >= self.limit:
            raise NonFiniteStop(f"{where}: {self.in_a_row} non-finite step(s) in a row, each skipped "
                                f"(--nonfinite_limit {self.limit}): stopping; {last}")


class UpdateGate:
    """In front of a plain torch optimizer (no ZeRO: DeepSpeed then checks nothing in fp32): its ``step`` runs only
    when every rank's gradients are finite and ``loss_finite`` holds on every rank (one all-gather of a flag per
    step through the comm layer); otherwise nothing changes, the optimizer reports ``overflow`` and DeepSpeed's
    engine counts the step as skipped and leaves the learning-rate schedule where it is."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, comm: Any, device: torch.device) -> None:
        self.optimizer, self.comm, self.device = optimizer, comm, device
        self.loss_finite = True
        self._inner_step = optimizer.step
        optimizer.step = self._step  # type: ignore[method-assign]
        optimizer.overflow = False  # type: ignore[attr-defined]

    @staticmethod
    def needed(engine: Any) -> torch.optim.Optimizer | None:
        """The engine's optimizer when it is a plain torch optimizer (DeepSpeed's own ones check for overflow)."""
        opt = getattr(engine, "optimizer", None)
        return opt if isinstance(opt, torch.optim.Optimizer) else None

    def _step(self, *args: Any, **kwargs: Any) -> Any:
        grads = [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        # one host sync for all gradients (not one per parameter: on a GPU each would stall the stream)
        ok = self.loss_finite and (not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all()))
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        with self.comm.phase("metrics"):
            flags = self.comm.all_gather(flag, dist.group.WORLD)
        skip = bool(flags.max() > 0)
        self.optimizer.overflow = skip  # type: ignore[attr-defined]
        self.loss_finite = True
        return None if skip else self._inner_step(*args, **kwargs)
