"""Which pieces of a full sequence each sequence-parallel rank holds (``sequence_chunk_ids``), and the tensor ops
that cut and rejoin them (``shard_sequence``, ``unshard_sequence``). Rank ``i = r * U + u`` holds two of 2P pieces,
or, with an explicit ``assignment`` (balanced sharding, ``balance.py``), its ring chunks, each cut U ways.

Design: Note [Hybrid sequence order] in docs/design/layouts.md.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .balance import check_assignment
from .chunks import check_divisible, chunk_ids

__all__ = [
    "Assignment",
    "check_sequence_length",
    "sequence_chunk_ids",
    "sequence_position_ids",
    "shard_sequence",
    "unshard_sequence",
]


Assignment = Sequence[Sequence[int]]
"""Per ring rank, the ids of the chunks it holds (``balance.Assignment``)."""


def _ring_count(sp_size: int, ulysses_degree: int, assignment: Assignment | None) -> int:
    u = ulysses_degree
    if u < 1 or sp_size % u:
        raise ValueError(f"ulysses_degree {u} must divide sequence_parallel_size {sp_size}")
    if assignment is not None:
        check_assignment(assignment)
        if len(assignment) != sp_size // u:
            raise ValueError(
                f"the assignment has {len(assignment)} ring ranks but sequence_parallel_size / ulysses_degree = "
                f"{sp_size} / {u} = {sp_size // u}: give one chunk list per ring rank"
            )
    return sp_size // u


def sequence_chunk_ids(
    index: int, *, sp_size: int, ulysses_degree: int = 1, scheme: str = "zigzag", assignment: Assignment | None = None
) -> tuple[int, ...]:
    """The pieces held by sequence-parallel rank ``index``, in local order: two of 2P under ``scheme``, or with
    an ``assignment`` (of n ring chunks) ``len(assignment[r])`` of n x U, ascending."""
    u = ulysses_degree
    _ring_count(sp_size, u, assignment)
    ring, sub = divmod(index, u)
    if assignment is not None:
        return tuple(c * u + sub for c in sorted(assignment[ring]))
    a, b = chunk_ids(ring, sp_size // u, scheme)
    return (a * u + sub, b * u + sub)


def _piece_count(sp_size: int, ulysses_degree: int, assignment: Assignment | None) -> int:
    """How many equal pieces the sequence is cut into: 2P, or (chunks of the assignment) x U."""
    if assignment is None:
        return 2 * sp_size
    return sum(len(a) for a in assignment) * ulysses_degree


def check_sequence_length(n: int, sp_size: int, *, pieces: int | None = None) -> None:
    """Raise unless a sequence of ``n`` tokens cuts into ``pieces`` equal pieces (default 2P), saying what to pad to."""
    if pieces is None or pieces == 2 * sp_size:
        check_divisible(n, sp_size)
    elif n <= 0 or n % pieces:
        lo = n - n % pieces
        raise ValueError(
            f"sequence length {n} is not divisible into the assignment's {pieces} equal pieces (ring chunks x "
            f"ulysses_degree): pad to {lo + pieces}" + (f" or truncate to {lo}" if lo else "")
        )


def shard_sequence(
    x: torch.Tensor,
    *,
    dim: int,
    index: int,
    sp_size: int,
    ulysses_degree: int = 1,
    scheme: str = "zigzag",
    assignment: Assignment | None = None,
) -> torch.Tensor:
    """Full sequence along ``dim`` -> rank ``index``'s pieces (``sequence_chunk_ids``), concatenated."""
    ids = sequence_chunk_ids(index, sp_size=sp_size, ulysses_degree=ulysses_degree, scheme=scheme,
                             assignment=assignment)
    count = _piece_count(sp_size, ulysses_degree, assignment)
    check_sequence_length(x.shape[dim], sp_size, pieces=count)
    pieces = x.chunk(count, dim=dim)
    return torch.cat([pieces[i] for i in ids], dim=dim)


def unshard_sequence(
    shards: Sequence[torch.Tensor],
    *,
    dim: int,
    ulysses_degree: int = 1,
    scheme: str = "zigzag",
    assignment: Assignment | None = None,
) -> torch.Tensor:
    """The shards of all P ranks (in index order) -> the full sequence."""
    p = len(shards)
    count = _piece_count(p, ulysses_degree, assignment)
    pieces: dict[int, torch.Tensor] = {}
    for i, s in enumerate(shards):
        ids = sequence_chunk_ids(i, sp_size=p, ulysses_degree=ulysses_degree, scheme=scheme, assignment=assignment)
        for c, piece in zip(ids, s.chunk(len(ids), dim=dim)):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in range(count)], dim=dim)


def sequence_position_ids(
    seq_len: int,
    *,
    index: int,
    sp_size: int,
    ulysses_degree: int = 1,
    scheme: str = "zigzag",
    assignment: Assignment | None = None,
) -> torch.Tensor:
    """Global position ids of rank ``index``'s tokens, [seq_len / P] (RoPE needs global positions)."""
    return shard_sequence(
        torch.arange(seq_len), dim=0, index=index, sp_size=sp_size, ulysses_degree=ulysses_degree, scheme=scheme,
        assignment=assignment,
    )
