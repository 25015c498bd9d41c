"""Writing a checkpoint's files beside training: a snapshot on the training thread, the writes in a thread.

``BackgroundWriter`` stands in for DeepSpeed's ``engine.checkpoint_engine`` for the length of one
``save_checkpoint``: each ``save(state_dict, path)`` copies the state's tensors to host memory at once (the
optimizer updates the live tensors in place at the next step), and ``start`` hands the copies to one thread that
writes each file through DeepSpeed's own engine under a temporary name, fsyncs it, renames it and fsyncs the
folder, then computes its line of the completion marker. ``checkpoint.PendingSave`` runs the collectives around it.

Design: Note [Asynchronous saves] in docs/design/training.md.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

from ..integration.ds_runtime import THREAD_PREFIX
from . import manifest

__all__ = ["BackgroundWriter", "fsync_dir", "fsync_file", "host_copy"]


def host_copy(item: Any, memo: dict[int, Any]) -> Any:
    """``item`` with every tensor replaced by a copy in host memory (pinned for a GPU tensor, so the copy runs
    asynchronously: synchronize before reading it) and dicts, lists and tuples rebuilt; other values as they are.
    A tensor reached twice is copied once (``memo``: id -> copy)."""
    if isinstance(item, torch.Tensor):
        if id(item) not in memo:
            t = item.detach()
            if t.device.type == "cpu":
                memo[id(item)] = t.clone()
            else:
                memo[id(item)] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        return memo[id(item)]
    if isinstance(item, dict):
        return type(item)((k, host_copy(v, memo)) for k, v in item.items())
    if isinstance(item, list):
        return [host_copy(v, memo) for v in item]
    if isinstance(item, tuple):
        values = [host_copy(v, memo) for v in item]
        return type(item)(*values) if hasattr(item, "_fields") else tuple(values)  # a named tuple keeps its type
    return item


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to its disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s entries (names created or renamed in it) to its disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BackgroundWriter:
    """DeepSpeed's checkpoint engine for one save whose files are written by a thread of their own.

    ``save`` (training thread, inside ``save_checkpoint``) snapshots; ``start`` starts the thread once DeepSpeed
    is done; ``done`` / ``join`` tell when it finished. Afterwards ``entries`` holds the marker's line of every
    file under ``tag_dir`` it wrote, or ``error`` says, in one line naming this rank and the file, why it stopped.
    """

    def __init__(self, inner: Any, *, tag_dir: Path, rank: int) -> None:
        self.inner = inner
        self.tag_dir = Path(tag_dir)
        self.rank = rank
        self.jobs: list[tuple[Any, Path]] = []
        self.entries: list[dict[str, Any]] = []
        self.error: str | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def save(self, state_dict: Any, path: str) -> None:
        if self._thread is not None:
            raise RuntimeError(f"BackgroundWriter.save({path!r}) after start: its thread is already writing")
        self.jobs.append((host_copy(state_dict, {}), Path(path)))

    def __getattr__(self, name: str) -> Any:  # makedirs, load, ...: DeepSpeed's engine
        return getattr(self.inner, name)

    def start(self) -> None:
        """Write the snapshots in a daemon thread (a process that ends first leaves the tag unmarked; a clean end
        joins it: ``close_distributed``)."""
        if self._thread is not None:
            raise RuntimeError("BackgroundWriter.start called twice")
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the pinned copies have landed before the thread reads them
        self._thread = threading.Thread(target=self._run, name=f"{THREAD_PREFIX}save-rank{self.rank}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        """Whether the thread has finished (written everything, or stopped at an error)."""
        return self._done.is_set()

    def join(self) -> None:
        if self._thread is None:
            raise RuntimeError("BackgroundWriter.join before start")
        self._thread.join()

    def _run(self) -> None:
        root = self.tag_dir.resolve()
        path = None
        try:
            while self.jobs:
                snapshot, path = self.jobs.pop(0)  # each snapshot freed once written
                self.write_durable(snapshot, path)
                del snapshot
                if root in path.resolve().parents:
                    self.entries.append(manifest.entry(self.tag_dir, path, rank=self.rank))
        except BaseException as e:  # noqa: BLE001 - reported on every rank by PendingSave, never lost in a thread
            self.error = f"rank {self.rank} could not write {path}: {type(e).__name__}: {e}"
            self.jobs.clear()
        finally:
            self._done.set()

    def write_durable(self, snapshot: Any, path: Path) -> None:
        """``snapshot`` written by DeepSpeed's engine to ``path`` as a whole or not at all, on disk when it returns."""
        tmp = path.with_name(f".{path.name}.tmp")  # hidden: never listed in a marker (manifest.files_under)
        self.inner.save(snapshot, str(tmp))
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
