"""Which chunks of a sequence each sequence-parallel rank holds, as pure integer math (no torch).

The sequence is cut into 2P equal chunks; rank ``i`` of P holds two of them:

- ``zigzag``     chunks (i, 2P-1-i): with a causal mask every rank does the same attention work
- ``contiguous`` chunks (2i, 2i+1): the last rank does about twice the average causal work
- ``balanced``   packed documents: P x ``chunks_per_rank`` chunks chosen by work per batch (``balance.py``);
  without documents it is zigzag (and ``chunk_ids`` answers zigzag's chunks)

``seq_len_divisor`` / ``check_divisible`` are the one home of the rule "the sequence length must be divisible by 2P".
Design: Note [Zigzag sharding], Note [Balanced sharding of packed documents] in docs/design/documents.md.
"""
from __future__ import annotations

__all__ = [
    "DEFAULT_CHUNKS_PER_RANK",
    "SHARDINGS",
    "check_divisible",
    "chunk_ids",
    "padded_length",
    "rank_chunks",
    "seq_len_divisor",
]

SHARDINGS: tuple[str, ...] = ("zigzag", "contiguous", "balanced")
"""The values of ``wallfacer.sharding``: which chunks each rank holds."""
DEFAULT_CHUNKS_PER_RANK = 8
"""Chunks per ring rank under "balanced". Measured on log-normal document mixes packed into 128K-token rows
(``benchmarks/bench_balance.py``, worst of 8 batches): with one row per micro-batch, the usual case at this length,
8 keeps the busiest rank within 1.006x the mean for P = 4..64, 4 only within 1.44x (a single chunk of a long
document's tail can outweigh a rank's share), zigzag 3.9x; with 4 rows, 4 already suffices (1.02x). More chunks
mean shorter kernel calls (P = 64: 256-token chunks at 128K)."""


def _check_scheme(scheme: str) -> None:
    if scheme not in SHARDINGS:
        raise ValueError(f"unknown sharding {scheme!r}; expected one of {SHARDINGS}")


def seq_len_divisor(sp_size: int) -> int:
    """What every sequence length must be a multiple of with ``sp_size`` sequence-parallel ranks: 2P (two chunks
    per rank; with Ulysses too, whose ranks hold two pieces each)."""
    return 2 * sp_size


def padded_length(seq_len: int, sp_size: int) -> int:
    """``seq_len`` rounded up to the next multiple of ``seq_len_divisor(sp_size)`` (what the loader pads to)."""
    unit = seq_len_divisor(sp_size)
    return -(-seq_len // unit) * unit


def check_divisible(seq_len: int, sp_size: int) -> None:
    """Every rank holds 2 of 2P equal chunks: the full sequence length must be a positive multiple of 2P."""
    unit = seq_len_divisor(sp_size)
    if seq_len % unit or seq_len <= 0:
        lo = seq_len - seq_len % unit if seq_len > 0 else 0
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x sequence_parallel_size = {unit}: pad to {lo + unit}"
            + (f" or truncate to {lo}" if lo else "")
            + f" (each of the {sp_size} sequence-parallel ranks holds 2 of {unit} equal chunks)"
        )


def chunk_ids(index: int, sp_size: int, scheme: str = "zigzag") -> tuple[int, int]:
    """The two global chunk indices (of 2P) held by sequence-parallel rank ``index``, in local order."""
    _check_scheme(scheme)
    if not 0 <= index < sp_size:
        raise ValueError(f"rank index {index} outside 0..{sp_size - 1}")
    if scheme in ("zigzag", "balanced"):  # "balanced" without documents is zigzag
        return (index, 2 * sp_size - 1 - index)
    return (2 * index, 2 * index + 1)


def rank_chunks(sp_size: int, scheme: str = "zigzag", assignment=None) -> tuple[tuple[int, ...], ...]:
    """The chunks every one of ``sp_size`` ranks holds, in local (ascending) order: a balanced ``assignment`` of a
    packed batch as given, else ``scheme``'s two (``chunk_ids``). Refuses a rank's chunks out of order."""
    held = tuple(tuple(assignment[i]) if assignment is not None else chunk_ids(i, sp_size, scheme)
                 for i in range(sp_size))
    for i, chunks in enumerate(held):
        if list(chunks) != sorted(chunks):
            raise ValueError(f"rank {i} holds chunks {chunks} out of order; a shard's chunks must ascend")
    return held
