"""The ring schedule's block calls: which (query chunks, key chunks) pairs a ring step computes, as pure integer
math (no torch). ``attention/wallfacer.py`` turns a rank's place into one list of calls per ring step.

A team of C consecutive ranks holds two contiguous runs of chunks (zigzag) or one (contiguous); sorted by chunk
index, every (query team, key team) pair needs at most one kernel call: full, causal-diagonal or skipped
(docs/design.md §2.2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..data.chunks import chunk_ids

__all__ = ["BlockCall", "block_calls", "call_work", "team_chunk_order"]


def team_chunk_order(
    team: Sequence[int], sp_size: int, scheme: str = "zigzag", *, assignment: Sequence[Sequence[int]] | None = None
) -> tuple[list[int], list[int]]:
    """For a team's all-gathered tokens (member by member, each member's chunks in local order):

    returns (``chunks``, ``perm``): the team's chunk ids sorted ascending, and for each sorted position the
    position in gathered order, so ``sorted = gathered[perm]`` at chunk granularity. ``assignment``: the chunks
    of every ring rank (a balanced sharding of a packed batch) instead of ``scheme``'s two.
    """
    gathered = [c for i in team for c in (assignment[i] if assignment is not None else chunk_ids(i, sp_size, scheme))]
    perm = sorted(range(len(gathered)), key=gathered.__getitem__)
    return [gathered[p] for p in perm], perm


@dataclass(frozen=True)
class BlockCall:
    """One block-kernel call: sorted query chunks [q_lo, q_hi) against sorted key chunks [k_lo, k_hi)."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool
    """Causal inside the call: only when the query and key chunks are the same run."""


def block_calls(q_chunks: Sequence[int], k_chunks: Sequence[int], *, causal: bool) -> list[BlockCall]:
    """The kernel calls for sorted query chunks against sorted key chunks.

    Non-causal: one full call. Causal: identical chunk lists give one causal call (positions ascend, so the
    mask of the concatenation is exactly the global causal mask); disjoint lists give full calls, one per run
    of queries that see the same prefix of keys (chunks below them); pairs with no visible key are skipped.
    """
    nq, nk = len(q_chunks), len(k_chunks)
    if not causal:
        return [BlockCall(0, nq, 0, nk, False)]
    if list(q_chunks) == list(k_chunks):
        return [BlockCall(0, nq, 0, nk, True)]
    if set(q_chunks) & set(k_chunks):
        raise ValueError(f"query chunks {q_chunks} and key chunks {k_chunks} partly overlap")
    calls: list[BlockCall] = []
    for qi, c in enumerate(q_chunks):
        seen = sum(1 for k in k_chunks if k < c)  # sorted keys: the visible ones are a prefix
        if seen == 0:
            continue
        if calls and calls[-1].k_hi == seen and calls[-1].q_hi == qi:
            last = calls[-1]
            calls[-1] = BlockCall(last.q_lo, qi + 1, 0, seen, False)
        else:
            calls.append(BlockCall(qi, qi + 1, 0, seen, False))
    return calls


def call_work(call: BlockCall, chunk_len: int) -> int:
    """Attention score entries a call computes (query-key pairs), for balance reports."""
    sq, sk = (call.q_hi - call.q_lo) * chunk_len, (call.k_hi - call.k_lo) * chunk_len
    return sq * (sq + 1) // 2 if call.causal else sq * sk
