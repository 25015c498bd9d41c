"""DeepSpeed as this package runs it: the rank's device, ``deepspeed.init_distributed`` with our timeout on every
group DeepSpeed makes, and the workarounds DeepSpeed's CPU accelerator needs (a stale JIT build lock, its
shared-memory buffers that are never unlinked). Only here does the package reach into DeepSpeed's private state
(``deepspeed.utils.groups._WORLD_GROUP``). Design: docs/design/dependencies.md, docs/design/faults.md."""
from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

__all__ = ["THREAD_PREFIX", "close_at_exit", "close_distributed", "init_distributed", "rank_device",
           "release_shm_buffer", "sweep_stale_shm_segments"]

log = logging.getLogger("ds_wallfacer.ds_runtime")


def rank_device() -> torch.device:
    """This rank's accelerator device, made current before any group is built: the device DeepSpeed's engine
    uses (``device_name(local_rank)``); NCCL groups create their communicators on the current device."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() == "cpu":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    acc.set_device(local_rank)
    return torch.device(acc.device_name(local_rank))


_STALE_BUILD_LOCK_S = 600.0


def _clear_stale_build_lock(op_name: str = "deepspeed_shm_comm") -> None:
    """Note [Stale JIT build lock]: on the CPU accelerator ``deepspeed.init_distributed`` JIT-loads a C++ op
    (``ShareMemCommBuilder``) under torch's file lock in the extensions directory. A rank killed while holding it
    (a crash, a timeout) leaves the lock behind, and every later run waits on it forever, before any process
    group or watchdog exists. A lock older than any build (10 minutes) is stale: local rank 0 removes it, with a
    warning, before initialising. Uses torch's private ``_get_build_directory``; does nothing if it is gone."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = Path(_get_build_directory(op_name, verbose=False)) / "lock"
        age = time.time() - lock.stat().st_mtime
    except Exception:  # noqa: BLE001 - no lock (the usual case), or torch's private helper changed
        return
    if age > _STALE_BUILD_LOCK_S:
        log.warning("ds_wallfacer: removing a stale torch extension build lock %s (%.0f s old): a run killed "
                    "while building %s left it, and it would block every rank forever", lock, age, op_name)
        lock.unlink(missing_ok=True)


def release_shm_buffer() -> None:
    """Note [DeepSpeed's CPU shared-memory buffers]: on the CPU accelerator DeepSpeed's all-reduce op creates one
    ~66 MB shared-memory segment per rank (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and
    never unlinks it, so every run leaks them into RAM (hundreds of runs filled a 24 GiB machine's /dev/shm). Each
    rank maps every peer's segment inside ``init_distributed``; once all ranks are past it (the caller's barrier),
    unlinking the name frees the memory when the last mapping goes, even if the run is killed later."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or not dist.is_initialized():
        return
    for seg in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{dist.get_rank()}"):
        seg.unlink(missing_ok=True)


_STALE_SEGMENT_S = 60.0
_SEGMENT_PREFIX = "deepspeed_allreduce_buffer_"


def sweep_stale_shm_segments() -> list[str]:
    """Note [DeepSpeed's CPU shared-memory buffers]: a rank killed before every rank has mapped the segments (so
    before ``release_shm_buffer``) leaves its job's in /dev/shm. Local rank 0 calls this before initialising: this
    user's segments that no process maps and that are older than a minute (so not a job starting right now)
    belong to no live job and are unlinked. Returns their names."""
    if os.environ.get("LOCAL_RANK", "0") not in ("0", "-1"):
        return []
    now = time.time()
    old = []
    for seg in Path("/dev/shm").glob(f"{_SEGMENT_PREFIX}{os.getuid()}_*"):
        try:
            if now - seg.stat().st_mtime > _STALE_SEGMENT_S:
                old.append(seg)
        except OSError:
            continue
    if not old:
        return []
    mapped = _mapped_segments()
    stale = [seg for seg in old if seg.name not in mapped]
    for seg in stale:
        seg.unlink(missing_ok=True)
    if stale:
        log.info("ds_wallfacer: removed %d stale /dev/shm segment(s) of killed jobs: %s", len(stale),
                 ", ".join(seg.name for seg in stale))
    return [seg.name for seg in stale]


def _mapped_segments() -> set[str]:
    """Names of the /dev/shm segments of DeepSpeed's all-reduce that some process of this user maps now."""
    names = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # gone, or another user's
            continue
        if _SEGMENT_PREFIX not in text:
            continue
        for line in text.splitlines():
            parts = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (if any)
            path = parts[5] if len(parts) == 6 else ""
            if f"/dev/shm/{_SEGMENT_PREFIX}" in path:
                names.add(Path(path.removesuffix(" (deleted)")).name)
    return names


def init_distributed(timeout: datetime.timedelta) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    cpu = get_accelerator().device_name() == "cpu"
    if cpu:
        _clear_stale_build_lock()
        sweep_stale_shm_segments()
    from deepspeed.utils import groups as ds_groups

    if not dist.is_initialized():
        deepspeed.init_distributed(timeout=timeout)
    elif not deepspeed.comm.is_initialized():
        deepspeed.init_distributed(dist_backend=dist.get_backend(), timeout=timeout)
    # Without an mpu, DeepSpeed's data-parallel group is a clone of the world group it creates lazily with
    # ``dist.new_group(ranks)``, which gets torch's default timeout (30 min for gloo), not the world's: create it
    # first, with ours.
    if getattr(ds_groups, "_WORLD_GROUP", 0) is None:
        ds_groups._WORLD_GROUP = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout)
    if cpu:
        if dist.get_world_size() > 1:
            dist.barrier()  # every rank has mapped every peer's segment (Note [DeepSpeed's CPU shared-memory buffers])
        release_shm_buffer()
    close_at_exit()


_WORKER_HANDBACK_S = 0.05
"""How long ``close_distributed`` leaves the GIL to c10d's worker threads (they need it for microseconds)."""

THREAD_PREFIX = "ds_wallfacer-"
"""The name every thread of this package starts with (watchdog, signal reader, checkpoint writer), so that
``close_distributed`` finds them without a registry."""


def close_distributed(*, timeout_s: float = 10.0) -> None:
    """Note [A clean exit] (docs/trainer.md): the end of every entry point (our trainer, the Trainer classes, the
    examples, the benchmarks' launched ranks). Joins this package's threads (already told to stop by their owners;
    ``timeout_s`` in all), destroys every process group of this process, the world's included, through DeepSpeed
    where it started them (it drops its own references too), collects the groups nothing else holds (their C++
    threads end while the interpreter is whole), and gives the workers of the groups still held the GIL they need
    to finish. Local, no collective; safe to call twice, with no group, and as an ``atexit`` handler: after an
    uncaught exception (``sys.last_value``) it leaves the groups alone, since a peer may still be inside a
    collective that destroying them would wait for."""
    if getattr(sys, "last_value", None) is not None:  # set by an uncaught exception before atexit handlers run
        return
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if t.name.startswith(THREAD_PREFIX) and t is not threading.current_thread():
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    if not (dist.is_available() and dist.is_initialized()):
        return
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    gc.collect()  # groups held only by reference cycles (an engine, a trainer) go now, not during finalisation
    # a gloo worker that ran one of the last collectives takes the GIL once more, to hand back the Python objects of
    # its tensors: give it the GIL now, while the interpreter can (the groups something still holds keep their
    # workers until finalisation)
    time.sleep(_WORKER_HANDBACK_S)


def close_at_exit() -> None:
    """Note [A clean exit] (docs/trainer.md): a script returns after its last step (``trainer.train()``, its own loop
    over ``initialize``'s engine) with the process groups alive, and nothing else destroys them. This registers
    ``close_distributed`` once per process to run at the interpreter's exit: atexit handlers run while the
    interpreter is whole, before it stops the threads (and not after an uncaught exception: ``close_distributed``).
    Called by ``init_distributed``, so every entry point of the package gets it without a new call."""
    atexit.unregister(close_distributed)
    atexit.register(close_distributed)
