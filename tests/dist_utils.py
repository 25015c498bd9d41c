"""Run a test body on N local gloo ranks and surface every rank's failure in the parent.

The spawner is the benchmarks' (``benchmarks/harness.py``), one for both. Here the ranks are forked from the test
process, which imported torch, DeepSpeed and transformers once (``tests/conftest.py``): a 4-rank launch then costs
about half a second instead of the tens of seconds four fresh interpreters spend importing them on a 2-core
machine. Where a fork is unsafe (a CUDA device, or a process group already in this process) they are spawned.
"""
from __future__ import annotations

from typing import Any, Callable

from benchmarks.harness import free_port, spawn_ranks

__all__ = ["default_start_method", "free_port", "run_distributed"]


def default_start_method() -> str:
    """"fork" unless this process holds what a fork cannot carry: CUDA (a forked child cannot use it) or a
    torch.distributed group (the child would inherit it)."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() or (dist.is_available() and dist.is_initialized()):
        return "spawn"
    return "fork"


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0,
                    start_method: str | None = None) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks (``harness.spawn_ranks``); the per-rank results.
    A failed rank raises an AssertionError with its traceback. ``start_method``: None = ``default_start_method()``."""
    return spawn_ranks(fn, world_size, *args, timeout_s=timeout_s, start_method=start_method or default_start_method())
