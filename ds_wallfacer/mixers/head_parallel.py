"""Head-parallel layout for recurrent mixers: one all-to-all turns this rank's sequence pieces of H heads into the
whole sequence, in order, of H / P heads; a second turns a result back.

A linear-attention or state-space scan carries a state from token to token, so unlike attention it cannot combine
per-block partial results; under sequence parallelism it either passes the state from piece to piece (a serial
chain over the 2P pieces) or, as here, gives each rank every token of some heads and runs the layer's own scan
unchanged. Heads are split in P contiguous groups: group rank j gets heads [j H / P, (j + 1) H / P) of every
tensor, so heads that work together (a value head and the key head it shares) stay on one rank when both counts
divide by P. The pieces each rank holds are ``ChunkRing``'s (zigzag, contiguous, hybrid or a balanced assignment).

Bytes per rank and call, each way: (P - 1) / P x the tensors' size on this rank, counted as kind "heads".

Design: Note [Gated delta-nets and Mamba-2 on shards] in docs/design/mixers.md.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.distributed as dist

from ..attention.ulysses import all_to_all
from ..comm import CommLayer
from .short_conv import ChunkRing

__all__ = ["gather_heads", "head_parallel_bytes", "scatter_heads"]


@lru_cache(maxsize=64)
def _order(ring: ChunkRing, group_shards: tuple[int, ...]) -> tuple[int, ...]:
    """For each global piece in sequence order, its row in [group rank, local slot] order."""
    m = len(ring.chunks)
    where = {c: j * m + s for j, shard in enumerate(group_shards) for s, c in enumerate(ring.pieces_of(shard))}
    return tuple(where[c] for c in range(len(where)))


def head_parallel_bytes(*, rows: int, tokens: int, width: int, element_size: int, sp_size: int) -> int:
    """Bytes this rank sends in one ``gather_heads`` or ``scatter_heads`` of tensors ``width`` elements wide per
    token (summed over the tensors) on ``tokens`` local tokens: every head group but its own, (P - 1) / P of them."""
    return (sp_size - 1) * rows * tokens * width * element_size // sp_size


def gather_heads(xs: list[torch.Tensor], *, ring: ChunkRing, group_shards: tuple[int, ...],
                 group: dist.ProcessGroup, comm: CommLayer) -> list[torch.Tensor]:
    """Each x [B, S_l, H, d] (this rank's pieces, local order; H divisible by P) -> [B, N, H / P, d]: the whole
    sequence in order for this rank's head group. One all-to-all for all tensors. ``group_shards``: the shard index
    of each rank of ``group``, in group order."""
    p = len(group_shards)
    m = len(ring.chunks)
    rows = []
    for x in xs:
        b, s, h, d = x.shape
        rows.append(x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).reshape(p, -1))
    recv = all_to_all(torch.cat(rows, dim=1), group, comm, kind="heads")
    order = torch.tensor(_order(ring, group_shards), device=recv.device)
    out, i = [], 0
    for x in xs:
        b, s, h, d = x.shape
        n = b * s * (h // p) * d
        y = recv[:, i:i + n].reshape(p, b, m, s // m, h // p, d).transpose(0, 1).reshape(b, p * m, s // m, h // p, d)
        out.append(y.index_select(1, order).reshape(b, p * s, h // p, d))
        i += n
    return out


def scatter_heads(x: torch.Tensor, *, ring: ChunkRing, group_shards: tuple[int, ...], group: dist.ProcessGroup,
                  comm: CommLayer) -> torch.Tensor:
    """Inverse of ``gather_heads`` for one tensor: [B, N, H / P, d] -> [B, S_l, H, d]."""
    p = len(group_shards)
    m = len(ring.chunks)
    b, n, h, d = x.shape
    s = n // p
    back = torch.tensor(_order(ring, group_shards), device=x.device).argsort()
    pieces = x.reshape(b, p * m, s // m, h, d).index_select(1, back)  # [B, group rank x slot, L, h, d]
    rows = pieces.reshape(b, p, s, h, d).transpose(0, 1).reshape(p, -1)
    recv = all_to_all(rows, group, comm, kind="heads")  # row j: head group j of my tokens
    return recv.reshape(p, b, s, h, d).permute(1, 2, 0, 3, 4).reshape(b, s, p * h, d)
