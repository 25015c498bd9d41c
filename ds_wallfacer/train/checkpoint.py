"""Checkpoints that resume exactly, and are never picked half-written.

``save`` writes DeepSpeed's checkpoint into ``<dir>/step_<n>`` with a client state holding the data position,
the step counters and every rank's RNG states (python, numpy, torch CPU, CUDA), then, once every rank has
finished writing, a completion marker inside the tag (``wallfacer_complete.json``) and only then the ``latest``
pointer (same name and format as DeepSpeed's, so DeepSpeed's tools read it). Both small files are written to a
temporary name and renamed, so a crash leaves either the old or the new one. DeepSpeed is asked not to write its
own ``latest`` (it would name a tag before we know every rank is done). ``find_resume`` trusts a tag only when its
marker is there: a tag dir without one (an interrupted save), whatever ``latest`` says, is skipped.

Resuming with another sequence-parallel split of the same world (P = 4 -> P = 2 x D = 2) needs no conversion:
DeepSpeed is handed every rank as a data-parallel replica (see ``integration/loss.py``), so ZeRO partitions the
same parameters over the same W ranks whatever the split, and the DeepSpeed files load as they are. The data
position is kept in sequences, which another split of the same global batch consumes identically.
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
    "MARKER", "POINTER", "find_resume", "load", "resolve_resume", "rng_for_rank", "rng_state", "save", "set_rng_state",
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


def load(engine: Any, tag_dir: Path) -> dict[str, Any]:
    """Load DeepSpeed's state from ``tag_dir`` (collective) and return the trainer's client state. RNG states are
    NOT restored here: call ``set_rng_state(rng_for_rank(state))`` last, right before training continues."""
    saved_world = json.loads((tag_dir / MARKER).read_text()).get("world_size")
    if saved_world != dist.get_world_size():  # checked first: DeepSpeed would fail inside the load on some ranks
        raise StartupError(
            f"{tag_dir} was written by {saved_world} ranks, this run has {dist.get_world_size()}: resume on "
            f"{saved_world} ranks (any sequence-parallel split of them works; ZeRO state is partitioned by rank)"
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
