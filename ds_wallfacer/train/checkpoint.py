"""Checkpoints that resume exactly, are never picked half-written, and are checked before they are loaded.

``save`` checks for room, writes DeepSpeed's checkpoint into ``<dir>/step_<n>`` with the data position, the step
counters and every rank's RNG states, and marks the tag complete, with every rank's file list, once every rank has
written it to disk (``asynchronous``: a thread writes the files, ``PendingSave.finalize`` marks the tag);
``resume_candidates`` lists the complete tags to try, ``choose_resume`` takes the first that every rank verifies;
``prune`` keeps the newest few; ``universal_copy`` converts a tag for another number of ranks.

Design: Notes [Checkpoints that resume exactly], [Verified checkpoints] and [Asynchronous saves] in
docs/design/training.md.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import manifest
from .async_save import BackgroundWriter, fsync_dir, fsync_file
from .cli import StartupError

__all__ = [
    "MARKER", "POINTER", "PendingSave", "SaveFailed", "SaveRefused", "check_space", "choose_resume", "find_resume",
    "load", "prune", "resolve_resume", "resume_candidates", "rng_for_rank", "rng_state", "save", "saved_world_size",
    "set_rng_state", "universal_copy", "verifiable",
]

MARKER = "wallfacer_complete.json"
POINTER = "latest"
_CLIENT_KEY = "wallfacer_train"
_TAG = re.compile(r"^step_(\d+)$")


class SaveRefused(StartupError):
    """A checkpoint refused before anything was written (too little free space): one line and exit status 2 on
    every rank, as a start-up refusal (``loop.main``)."""


class SaveFailed(StartupError):
    """A checkpoint whose files a rank could not write (an asynchronous save's writer failed): the tag stays
    unmarked; one line naming the rank and the file, and exit status 2, on every rank."""


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
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}.tmp")  # unique on a shared disk
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _node_leader() -> bool:
    """Whether this rank writes its node's copy of the small shared files (marker, ``latest``) and deletes its
    node's old tags: local rank 0 (rank 0 without a launcher). Note [Verified checkpoints]: per-node disks."""
    local = os.environ.get("LOCAL_RANK")
    return int(local) <= 0 if local is not None else dist.get_rank() == 0


class _Recorder:
    """DeepSpeed's checkpoint engine for the length of one save, noting every path written through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.paths: list[Path] = []

    def save(self, state_dict: Any, path: str) -> Any:
        result = self.inner.save(state_dict, path)
        fsync_file(Path(path))  # on disk before the marker says so
        fsync_dir(Path(path).parent)
        self.paths.append(Path(path))
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@contextlib.contextmanager
def _recording(engine: Any) -> Iterator[list[Path]]:
    """The files this rank writes through ``engine.checkpoint_engine`` (all of DeepSpeed's own checkpoint files)
    inside the block; an engine without one records nothing (rank 0 then lists the tag, see ``save``)."""
    inner = getattr(engine, "checkpoint_engine", None)
    if inner is None:
        yield []
        return
    recorder = _Recorder(inner)
    with _engine_swapped(engine, recorder):
        yield recorder.paths


@contextlib.contextmanager
def _engine_swapped(engine: Any, stand_in: Any) -> Iterator[None]:
    """``engine.checkpoint_engine`` is ``stand_in`` inside the block."""
    inner = engine.checkpoint_engine
    engine.checkpoint_engine = stand_in
    try:
        yield
    finally:
        engine.checkpoint_engine = inner


def check_space(ckpt_dir: Path, *, tag: str, estimate: tuple[int, str], group: Any) -> None:
    """Collective: raise ``SaveRefused`` on every rank when any rank's file system has less free space where
    ``tag`` goes than ``estimate`` (bytes, how they were estimated: ``manifest.estimate_bytes``)."""
    need, how = estimate
    seen: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, (manifest.free_bytes(ckpt_dir), socket.gethostname()), group=group)
    short = [(rank, free, host) for rank, (free, host) in enumerate(seen) if free < need]
    if short:
        rank, free, host = short[0]
        raise SaveRefused(
            f"no room for checkpoint {tag} in {ckpt_dir} (rank {rank}, {host}): it needs about "
            f"{manifest.format_bytes(need)} ({how}), {manifest.format_bytes(free)} free: free space or point "
            "--output_dir elsewhere, then --resume auto"
        )


def save(engine: Any, ckpt_dir: str | Path, *, step: int, state: dict[str, Any], estimate: tuple[int, str],
         group: Any, asynchronous: bool = False) -> Path | PendingSave:
    """Collective: every rank calls it at the same step. Refuses (``SaveRefused``) before writing anything when a
    rank has too little room for ``estimate``. Returns the tag directory, marked complete; ``asynchronous``: a
    ``PendingSave`` as soon as this rank's state is copied to host memory, its files still being written (Note
    [Asynchronous saves])."""
    ckpt_dir = Path(ckpt_dir)
    tag = f"step_{step}"
    tag_dir = ckpt_dir / tag
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    check_space(ckpt_dir, tag=tag, estimate=estimate, group=group)
    if _node_leader():
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        (tag_dir / MARKER).unlink(missing_ok=True)  # re-saving a tag: incomplete until rewritten
    rngs: list[Any] = [None] * world
    dist.all_gather_object(rngs, rng_state(), group=group)  # also orders the unlink before any rank writes
    client = {_CLIENT_KEY: {**state, "step": step, "world_size": world, "rng": rngs}}
    if asynchronous:
        writer = BackgroundWriter(engine.checkpoint_engine, tag_dir=tag_dir, rank=rank)
        with _engine_swapped(engine, writer):
            engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False)
        writer.start()
        return PendingSave(writer, ckpt_dir=ckpt_dir, step=step, group=group)
    with _recording(engine) as written:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state=client, save_latest=False)
    root = tag_dir.resolve()
    mine = [manifest.entry(tag_dir, p, rank=rank) for p in written if root in p.resolve().parents]
    _mark(ckpt_dir, tag_dir, step=step, mine=mine, error=None, group=group)
    return tag_dir


def _mark(ckpt_dir: Path, tag_dir: Path, *, step: int, mine: list[dict[str, Any]], error: str | None,
          group: Any) -> None:
    """Collective, once every rank's files of ``tag_dir`` are on disk (``mine``: this rank's marker lines): the
    marker, then ``latest``. ``error`` (this rank could not write a file) on any rank: ``SaveFailed`` on every rank
    and no marker."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    lists: list[Any] = [None] * world
    dist.all_gather_object(lists, (mine, error), group=group)  # every rank's files are written
    failed = next((e for _, e in lists if e is not None), None)
    if failed is not None:
        raise SaveFailed(_failed_line(tag_dir, failed))
    marker: list[Any] = [None]
    if rank == 0:
        files = [e for listed, _ in lists for e in listed]
        claimed = {e["path"] for e in files}
        root = tag_dir.resolve()
        # files DeepSpeed wrote past its checkpoint engine (NVMe offload copies, its recovery script): rank 0
        # answers for what it sees
        for p in manifest.files_under(tag_dir, skip=(MARKER,)):
            if p.resolve().relative_to(root).as_posix() not in claimed:
                fsync_file(p)
                files.append(manifest.entry(tag_dir, p, rank=0))
        marker[0] = {"step": step, "tag": tag_dir.name, "world_size": world, "time": time.time(),
                     "checksum": manifest.CHECKSUM, "files": files}
    dist.broadcast_object_list(marker, src=0, group=group)
    if _node_leader():  # every node its own copy: node-local disks see their own files and this list
        _write_atomic(tag_dir / MARKER, json.dumps(marker[0]))
        _write_atomic(ckpt_dir / POINTER, tag_dir.name)
    dist.barrier(group=group)


def _failed_line(tag_dir: Path, error: str) -> str:
    return (f"checkpoint {tag_dir.name} was not written: {error}; the tag stays unmarked (--resume auto skips it): "
            "free space or fix the folder's permissions, then --resume auto")


class PendingSave:
    """An asynchronous save (``save(..., asynchronous=True)``): this rank's files are being written by its
    ``BackgroundWriter``. Every rank holds one for the same tag and calls the collectives ``poll`` and ``finalize``
    at the same points (Note [Asynchronous saves]); the tag is marked complete by ``finalize`` only."""

    def __init__(self, writer: BackgroundWriter, *, ckpt_dir: Path, step: int, group: Any) -> None:
        self._writer = writer
        self.ckpt_dir = ckpt_dir
        self.tag_dir = writer.tag_dir
        self.step = step
        self._group = group
        self._finalized = False

    def poll(self, comm: Any, *, device: torch.device) -> bool:
        """Collective (one all-reduce of 2 numbers through ``comm``): whether every rank's writer is done. A
        writer that failed on any rank raises ``SaveFailed`` on every rank, with that rank's line."""
        if self._finalized:
            raise RuntimeError(f"PendingSave.poll of {self.tag_dir.name} after finalize")
        error = self._writer.error  # read before done: a writer sets its error first
        flags = torch.tensor([float(self._writer.done()), float(error is not None)], device=device)
        with comm.phase("checkpoint"):
            total = comm.all_reduce(flags, self._group, kind="check")  # [ranks done, ranks failed]
        if total[1] > 0:
            errors: list[Any] = [None] * dist.get_world_size(self._group)
            dist.all_gather_object(errors, error, group=self._group)  # the ranks that failed say why
            raise SaveFailed(_failed_line(self.tag_dir, next(e for e in errors if e is not None)))
        return int(total[0]) == dist.get_world_size(self._group)

    def finalize(self) -> Path:
        """Collective: wait for this rank's writer, then mark the tag complete (``SaveFailed`` on every rank when a
        writer failed). Once; returns the tag directory."""
        if self._finalized:
            raise RuntimeError(f"PendingSave.finalize of {self.tag_dir.name} called twice")
        self._finalized = True
        self._writer.join()
        _mark(self.ckpt_dir, self.tag_dir, step=self.step, mine=self._writer.entries, error=self._writer.error,
              group=self._group)
        return self.tag_dir


def _complete(tag_dir: Path) -> bool:
    return (tag_dir / MARKER).is_file()


def _marker(tag_dir: Path) -> dict[str, Any]:
    return json.loads((tag_dir / MARKER).read_text())


def verifiable(tag_dir: Path) -> bool:
    """Whether the tag's marker lists its files (written by a trainer that verifies; pure)."""
    return "files" in _marker(tag_dir)


def _problem(tag_dir: Path, *, universal: bool, rank: int, world: int) -> str | None:
    """Why this rank cannot resume from ``tag_dir``, or None: a file of the ranks it answers for (saved rank k is
    checked by rank k mod world: each rank its own files when the world is the same) that differs from the
    marker, or a tag that needs another load path than the one the engine was built for."""
    if not _complete(tag_dir):
        return f"no {MARKER} on rank {rank}'s file system"
    try:  # a verdict, never an exception: the other ranks are waiting for this one's in a collective
        meta = _marker(tag_dir)
        if (int(meta["world_size"]) != world) != universal:
            return (f"written by {meta['world_size']} ranks, which needs another load path than the newest "
                    f"tag's: resume it with --resume {tag_dir}")
        if "files" not in meta:
            return None  # written before markers listed files: complete, unverifiable
        return manifest.problem(tag_dir, (e for e in meta["files"] if int(e["rank"]) % world == rank))
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"unreadable on rank {rank} ({type(e).__name__}: {e})"


def choose_resume(candidates: Sequence[Path], *, universal: bool, group: Any) -> tuple[Path | None, list[str]]:
    """Collective: the first of rank 0's ``candidates`` that every rank verifies (None: none does), and for each
    one skipped ``"<tag>: <why>"``; the same answer on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    names: list[Any] = [[str(c) for c in candidates]]
    dist.broadcast_object_list(names, src=0, group=group)  # node-local disks may list different tags
    skipped: list[str] = []
    for tag_dir in map(Path, names[0]):
        verdicts: list[Any] = [None] * world
        dist.all_gather_object(verdicts, _problem(tag_dir, universal=universal, rank=rank, world=world), group=group)
        why = next((v for v in verdicts if v is not None), None)
        if why is None:
            return tag_dir, skipped
        skipped.append(f"{tag_dir.name}: {why}")
    return None, skipped


def prune(ckpt_dir: Path, *, keep: int, protect: Sequence[Path], group: Any) -> list[str]:
    """Collective: delete all but the newest ``keep`` complete tags (and their universal copies), never one in
    ``protect``. Rank 0 chooses; each node's local rank 0 deletes on its disk (marker first, so a tag half deleted
    is never taken for complete). Returns the tags deleted."""
    chosen: list[Any] = [None]
    if dist.get_rank(group) == 0:
        tags = sorted((int(m.group(1)), d.name) for d in ckpt_dir.iterdir()
                      if (m := _TAG.match(d.name)) and _complete(d))
        kept = {name for _, name in tags[-keep:]} | {p.name for p in protect}
        chosen[0] = [name for _, name in tags if name not in kept]
    dist.broadcast_object_list(chosen, src=0, group=group)
    if _node_leader():
        for name in chosen[0]:
            for d in (ckpt_dir / name, ckpt_dir / f"{name}_universal"):
                (d / MARKER).unlink(missing_ok=True)
                shutil.rmtree(d, ignore_errors=True)  # another node's leader may delete a shared disk's files too
    return chosen[0]


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


def resume_candidates(resume: str | None, output_dir: str | Path) -> list[Path]:
    """``--resume`` -> the complete tags to try, in order (empty: start fresh). ``auto``: ``find_resume``'s choice,
    then the older complete tags, newest first; a path: its tag only. Pure: no process group exists yet, so
    nothing is verified here (``choose_resume``)."""
    if resume is None:
        return []
    if resume == "auto":
        ckpt_dir = Path(output_dir) / "checkpoints"
        first = find_resume(ckpt_dir)
        if first is None:
            return []
        step = int(_TAG.match(first.name).group(1)) if _TAG.match(first.name) else None
        older = sorted(((int(m.group(1)), d) for d in ckpt_dir.iterdir()
                        if (m := _TAG.match(d.name)) and _complete(d) and d != first
                        and (step is None or int(m.group(1)) < step)), reverse=True)
        return [first, *(d for _, d in older)]
    path = Path(resume)
    if _complete(path):
        return [path]
    found = find_resume(path)
    if found is None:
        raise StartupError(f"--resume {resume!r} is not a complete checkpoint (no {MARKER}: an interrupted save, or "
                           "not written by this trainer): give a tag directory with the marker, or \"auto\"")
    return [found]


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """``--resume`` -> the first tag ``resume_candidates`` lists (None: start fresh). Pure."""
    candidates = resume_candidates(resume, output_dir)
    return candidates[0] if candidates else None


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
        meta = {k: v for k, v in _marker(tag_dir).items() if k != "files"}  # other files: not verifiable
        _write_atomic(out / MARKER, json.dumps({**meta, "converted_from": tag_dir.name}))
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
