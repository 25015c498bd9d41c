"""What a checkpoint tag holds, checked without torch: the file list of its completion marker (path, size, CRC32
per file, and the rank that wrote it), the check of a rank's files against it, the size a new tag will take and the
free space where it goes.

Pure (file system only): no ``torch.distributed``; ``checkpoint.py`` runs the collectives around it. Design: Note
[Verified checkpoints] in docs/design/training.md (why CRC32 of whole files, who checks which file, the size estimate).
"""
from __future__ import annotations

import shutil
import zlib
from pathlib import Path
from typing import Any, Iterable

__all__ = [
    "ADAM_BYTES_PER_PARAM", "CHECKSUM", "entry", "estimate_bytes", "files_under", "format_bytes", "free_bytes",
    "problem", "tag_bytes",
]

CHECKSUM = "crc32"
"""The checksum the marker's entries hold: zlib's CRC32 of the whole file (Note [Verified checkpoints])."""
ADAM_BYTES_PER_PARAM = 12
"""Optimizer state per parameter for the first save's estimate: fp32 master copy, Adam's m and v."""
_CHUNK = 16 << 20


def crc32(path: Path) -> int:
    """CRC32 of the whole file, read in 16 MiB chunks."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def entry(tag_dir: Path, path: Path, *, rank: int) -> dict[str, Any]:
    """The marker's line for one file of ``tag_dir``, written (and checked at resume) by ``rank``."""
    return {"path": Path(path).resolve().relative_to(Path(tag_dir).resolve()).as_posix(), "rank": rank,
            "bytes": Path(path).stat().st_size, CHECKSUM: f"{crc32(Path(path)):08x}"}


def files_under(tag_dir: Path, *, skip: Iterable[str] = ()) -> list[Path]:
    """Every regular file under ``tag_dir`` but the names in ``skip`` and hidden (temporary) ones, sorted."""
    skip = set(skip)
    return sorted(p for p in Path(tag_dir).rglob("*")
                  if p.is_file() and p.name not in skip and not p.name.startswith("."))


def problem(tag_dir: Path, entries: Iterable[dict[str, Any]]) -> str | None:
    """The first of ``entries`` whose file under ``tag_dir`` is missing, or differs in size or CRC32 from the
    marker; None when all match. Sizes first: a truncated file is named without reading it."""
    entries = list(entries)
    for e in entries:
        p = Path(tag_dir) / e["path"]
        if not p.is_file():
            return f"{e['path']} is missing (written by rank {e['rank']})"
        if (size := p.stat().st_size) != e["bytes"]:
            return f"{e['path']} is {size} bytes, the marker says {e['bytes']}"
    for e in entries:
        if (got := f"{crc32(Path(tag_dir) / e['path']):08x}") != e[CHECKSUM]:
            return f"{e['path']} has CRC32 {got}, the marker says {e[CHECKSUM]}"
    return None


def tag_bytes(tag_dir: Path) -> int:
    """Bytes of the files under ``tag_dir`` that this rank's file system holds (the whole tag on a shared file
    system, this node's share on a node-local disk)."""
    return sum(p.stat().st_size for p in files_under(tag_dir))


def estimate_bytes(previous: Path | None, *, params: int, param_bytes: int) -> tuple[int, str]:
    """The bytes the next tag will take on this rank's file system, and how that was estimated: the previous tag's
    size here when there is one, else parameters x (parameter bytes + Adam's 12) for the whole tag."""
    if previous is not None and previous.is_dir() and (n := tag_bytes(previous)):
        return n, f"the size of {previous.name}"
    per = param_bytes + ADAM_BYTES_PER_PARAM
    return params * per, f"{params} parameters x {per} bytes"


def free_bytes(path: Path) -> int:
    """Free bytes of the file system that holds ``path`` (or its nearest existing parent). The probe the space
    check asks; a test patches it."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def format_bytes(n: int) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
