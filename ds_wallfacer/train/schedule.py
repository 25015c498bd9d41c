"""The learning-rate schedule of the trainer's options: linear warm-up, then cosine / linear decay (or constant).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

__all__ = ["lr_factor", "scheduler_of"]


def lr_factor(*, steps: int, warmup_steps: int, decay: str, min_ratio: float) -> Callable[[int], float]:
    """Learning-rate multiplier by optimizer step: linear warm-up, then cosine / linear decay to ``min_ratio``
    at ``steps`` (or constant)."""

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if decay == "constant":
            return 1.0
        frac = min(1.0, (s - warmup_steps) / max(1, steps - warmup_steps))
        if decay == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1 - (1 - min_ratio) * frac

    return factor


def scheduler_of(args: Any) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]:
    """The warm-up + decay schedule of the options, as the callable DeepSpeed builds it from (with its optimizer)."""
    factor = lr_factor(steps=args.steps, warmup_steps=args.warmup_steps, decay=args.lr_decay,
                       min_ratio=args.min_lr_ratio)

    def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    return scheduler
