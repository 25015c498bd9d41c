"""Checkpoints that resume exactly, and are never picked half-written.

``save`` writes DeepSpeed's checkpoint into ``<dir>/step_<n>`` with the data position, the step counters and every
rank's RNG states, and marks the tag complete once every rank has written it; ``find_resume`` picks only complete
tags; ``universal_copy`` converts a tag for another number of ranks.

Design: Note [Checkpoints that resume exactly] in docs/design.md §9 (the marker and ``latest``, other splits).
"""
from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .cli import StartupError

__all__ = [
    "MARKER", "POINTER", "find_resume", "load", "resolve_resume", "rng_for_rank", "rng_state", "save",
    "saved_world_size", "set_rng_state", "universal_copy",
]

MARKER = "wallfacer_complete.json"
POINTER = "latest"
_CLIENT_KEY = "wallfacer_train"
_TAG = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    """This process's random number generator states."""
    state: dict[str, Any] = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save(engine: Any, ckpt_dir: str | Path, *, step: int, state: dict[str, Any]) -> Path:
    """Collective: every rank calls it at the same step. Returns the tag directory."""
    ckpt_dir = Path(ckpt_dir)
    tag = f"step_{step}"
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (ckpt_dir / tag / MARKER).unlink(missing_ok=True)  # re-saving a tag: incomplete until rewritten
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, rng_state())  # also orders the unlink before any rank writes
    client = {_CLIENT_KEY: {**state, "step": step, "world_size": world, "rng": rngs}}
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False)
    dist.barrier()  # every rank's files are written
    if rank == 0:
        _write_atomic(ckpt_dir / tag / MARKER, json.dumps({"step": step, "tag": tag, "world_size": world,
                                                           "time": time.time()}))
        _write_atomic(ckpt_dir / POINTER, tag)
    dist.barrier()
    return ckpt_dir / tag


def _complete(tag_dir: Path) -> bool:
    return (tag_dir / MARKER).is_file()


def find_resume(ckpt_dir: str | Path) -> Path | None:
    """The tag ``latest`` names if it is complete, else the complete tag with the highest step, else None."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return None
    pointer = ckpt_dir / POINTER
    if pointer.is_file():
        named = ckpt_dir / pointer.read_text().strip()
        if named.name and _complete(named):
            return named
    tags = [(int(m.group(1)), d) for d in ckpt_dir.iterdir() if (m := _TAG.match(d.name)) and _complete(d)]
    return max(tags)[1] if tags else None


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """``--resume`` -> the tag directory to load (None: start fresh). Pure, so every rank agrees."""
    if resume is None:
        return None
    if resume == "auto":
        return find_resume(Path(output_dir) / "checkpoints")
    path = Path(resume)
    if _complete(path):
        return path
    found = find_resume(path)
    if found is None:
        raise StartupError(f"--resume {resume!r} is not a complete checkpoint (no {MARKER}: an interrupted save, or "
                           "not written by this trainer): give a tag directory with the marker, or \"auto\"")
    return found


def saved_world_size(tag_dir: Path) -> int:
    """Ranks that wrote the checkpoint (from its marker; pure)."""
    return int(json.loads((tag_dir / MARKER).read_text())["world_size"])


def universal_copy(tag_dir: Path) -> Path:
    """Collective: DeepSpeed's universal checkpoint of ``tag_dir`` (``<tag>_universal`` beside it, converted once by
    rank 0 with ``ds_to_universal``): ZeRO state per parameter, loadable by any number of ranks."""
    import argparse
    import shutil

    out = tag_dir.with_name(f"{tag_dir.name}_universal")
    if dist.get_rank() == 0 and not _complete(out):
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        shutil.rmtree(out, ignore_errors=True)
        ds_to_universal(argparse.Namespace(
            input_folder=str(tag_dir), output_folder=str(out), num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=True,
        ))
        _write_atomic(out / MARKER, (tag_dir / MARKER).read_text())
    dist.barrier()
    return out


def load(engine: Any, tag_dir: Path, *, universal: bool = False) -> dict[str, Any]:
    """Load DeepSpeed's state from ``tag_dir`` (collective) and return the trainer's client state. ``universal``
    (the ds_config has ``"checkpoint": {"load_universal": true}``): through ``universal_copy``, for a checkpoint
    written by another number of ranks. RNG states are NOT restored here: call
    ``set_rng_state(rng_for_rank(state))`` last, right before training continues."""
    saved_world = saved_world_size(tag_dir)
    if universal:
        tag_dir = universal_copy(tag_dir)
    elif saved_world != dist.get_world_size():  # checked first: DeepSpeed would fail inside the load on some ranks
        raise StartupError(
            f"{tag_dir} was written by {saved_world} ranks, this run has {dist.get_world_size()}: start with "
            '"checkpoint": {"load_universal": true} handled by the trainer (resume through ds_wallfacer.train)'
        )
    path, client = engine.load_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    if path is None or not client or _CLIENT_KEY not in client:
        raise StartupError(f"{tag_dir} holds no trainer state: it was not written by ds_wallfacer.train")
    return client[_CLIENT_KEY]


def rng_for_rank(state: dict[str, Any]) -> dict[str, Any]:
    """This rank's saved RNG states."""
    rngs = state["rng"]
    rank = dist.get_rank()
    return rngs[rank] if rank < len(rngs) else rngs[0]
