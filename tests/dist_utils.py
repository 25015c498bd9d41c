"""Run a test body on N local gloo ranks and surface every rank's failure in the parent.

The ranks are forked from the test process, which imported torch, DeepSpeed and transformers once
(``tests/conftest.py``): a 4-rank launch then costs about half a second instead of the tens of seconds that four
fresh interpreters spend importing them on a 2-core machine. Where forking is unsafe (a CUDA device, or a process
group already in this process) the ranks are spawned instead.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp

__all__ = ["default_start_method", "free_port", "run_distributed"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue, timeout_s: float) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        DS_ACCELERATOR="cpu",
        WANDB_MODE="offline",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        # DeepSpeed's CPU all-reduce segment of this rank, if a test initialised DeepSpeed without our initialize
        for seg in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_{rank}"):
            seg.unlink(missing_ok=True)


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
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be a module-level function. A rank that raises makes this raise with that rank's traceback; a rank
    that hangs is killed after ``timeout_s``. ``start_method``: None = ``default_start_method()``.
    """
    ctx = mp.get_context(start_method or default_start_method())
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, timeout_s), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import queue as queue_mod

    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s + 60)
    while len(results) + len(errors) < world_size:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        try:
            rank, status, payload = queue.get(timeout=max(1.0, min(remaining, 5.0)))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
            if dead and all(not p.is_alive() for p in procs):
                for r in dead:
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode} and reported nothing"
                break
            if remaining <= 0:
                break
            continue
        (results if status == "ok" else errors)[rank] = payload
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors:
        first = min(errors)
        raise AssertionError(
            f"{len(errors)} of {world_size} ranks failed; rank {first}:\n{errors[first]}"
        )
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise AssertionError(f"ranks {missing} did not finish within {timeout_s}s (hang?)")
    return [results[r] for r in range(world_size)]
