"""Sequence sharding: zigzag / contiguous chunk maps, shard <-> full, global position ids, block schedule.

The sequence is cut into 2P equal chunks. Rank ``i`` of P holds two of them:

- ``zigzag``     chunks (i, 2P-1-i): with a causal mask every rank does the same attention work
- ``contiguous`` chunks (2i, 2i+1): the last rank does about twice the average causal work

A team of C consecutive ranks then holds two contiguous runs of chunks (zigzag) or one (contiguous);
sorted by chunk index, every (query team, key team) pair needs at most one kernel call (``block_calls``).
The integer math here is pure; the tensor helpers only slice and concatenate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = [
    "SCHEMES",
    "BlockCall",
    "block_calls",
    "call_work",
    "check_divisible",
    "chunk_ids",
    "position_ids",
    "shard",
    "team_chunk_order",
    "unshard",
]

SCHEMES = ("zigzag", "contiguous")


def _check_scheme(scheme: str) -> None:
    if scheme not in SCHEMES:
        raise ValueError(f"unknown sharding scheme {scheme!r}; expected one of {SCHEMES}")


def check_divisible(seq_len: int, sp_size: int) -> None:
    """Every rank holds 2 of 2P equal chunks: the full sequence length must be divisible by 2P."""
    if seq_len % (2 * sp_size) != 0:
        lo = seq_len - seq_len % (2 * sp_size)
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2*P = {2 * sp_size} (P = {sp_size} sequence-"
            f"parallel ranks, two chunks each): pad the batch to {lo + 2 * sp_size} tokens"
            + (f" or truncate it to {lo}" if lo else "")
        )


def chunk_ids(index: int, sp_size: int, scheme: str = "zigzag") -> tuple[int, int]:
    """The two global chunk indices (of 2P) held by sequence-parallel rank ``index``, in local order."""
    _check_scheme(scheme)
    if not 0 <= index < sp_size:
        raise ValueError(f"rank index {index} outside 0..{sp_size - 1}")
    if scheme == "zigzag":
        return (index, 2 * sp_size - 1 - index)
    return (2 * index, 2 * index + 1)


def team_chunk_order(team: Sequence[int], sp_size: int, scheme: str = "zigzag") -> tuple[list[int], list[int]]:
    """For a team's all-gathered tokens (member by member, each member's two chunks in local order):

    returns (``chunks``, ``perm``): the team's chunk ids sorted ascending, and for each sorted position the
    position in gathered order, so ``sorted = gathered[perm]`` at chunk granularity.
    """
    gathered = [c for i in team for c in chunk_ids(i, sp_size, scheme)]
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


# -- tensors ------------------------------------------------------------------------------------


def shard(x: torch.Tensor, *, dim: int, index: int, sp_size: int, scheme: str = "zigzag") -> torch.Tensor:
    """Full sequence -> rank ``index``'s shard (its two chunks, concatenated in local order)."""
    check_divisible(x.shape[dim], sp_size)
    chunks = x.chunk(2 * sp_size, dim=dim)
    return torch.cat([chunks[c] for c in chunk_ids(index, sp_size, scheme)], dim=dim)


def unshard(shards: Sequence[torch.Tensor], *, dim: int, scheme: str = "zigzag") -> torch.Tensor:
    """The shards of all P ranks (in rank order) -> the full sequence."""
    p = len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for i, s in enumerate(shards):
        for c, piece in zip(chunk_ids(i, p, scheme), s.chunk(2, dim=dim)):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in range(2 * p)], dim=dim)


def position_ids(seq_len: int, *, index: int, sp_size: int, scheme: str = "zigzag") -> torch.Tensor:
    """Global position ids of rank ``index``'s tokens (RoPE needs them), shape [seq_len / P]."""
    return shard(torch.arange(seq_len), dim=0, index=index, sp_size=sp_size, scheme=scheme)
