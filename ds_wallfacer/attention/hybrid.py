"""The hybrid: Ulysses degree U inside (consecutive ranks, one node) x WallFacer over R = P / U outside
(docs/design.md §3; a 2D mesh like USP / Megatron "a2a+p2p", with multi-ring instead of one ring).

Rank ``i = r * U + u`` of a sequence-parallel group holds pieces ``a*U + u`` and ``b*U + u`` of the 2P pieces
of a sequence, where (a, b) are ring rank r's two chunks of 2R (zigzag: (r, 2R-1-r)). The Ulysses all-to-all
over (r, 0..U-1) gathers those pieces into exactly ring rank r's two chunks, in order, with U times fewer heads:
the input ``WallFacerAttention`` expects over the ring group (r = 0..R-1, same u). The data loader produces
this layout (``ds_wallfacer.data.loader.sequence_chunk_ids``); U = 1 is WallFacer alone, R = 1 Ulysses alone.

Communication per rank and layer: Ulysses' all-to-all (``volume.ulysses_bytes(shape, degree=U, sp_size=P)``)
plus WallFacer's over R ranks with U-times fewer heads (``volume.wallfacer_bytes`` on that shape).
"""
from __future__ import annotations

import torch.distributed as dist

from ..comm import CommLayer, WallFacerGroups
from .ulysses import InnerAttention, LocalAttention, UlyssesAttention
from .wallfacer import WallFacerAttention

__all__ = ["sequence_parallel_attention"]


def sequence_parallel_attention(
    *,
    ulysses_group: dist.ProcessGroup | None,
    wallfacer_groups: WallFacerGroups | None,
    comm: CommLayer,
    kernel: str = "auto",
    sharding: str = "zigzag",
    sp_group: dist.ProcessGroup | None = None,
) -> InnerAttention:
    """This rank's attention for any mode: Ulysses over ``ulysses_group`` (None: U = 1) around WallFacer over
    ``wallfacer_groups`` (None: R = 1, attention over the gathered sequence is local). Neither (P = 1: one
    rank per sequence, plain data parallelism or a single GPU) is local attention with the same kernels and no
    collective at all. ``sp_group``: all ranks of the sequence, whose inputs Ulysses checks agree (None: the
    Ulysses group only)."""
    inner: InnerAttention = (
        LocalAttention(kernel=kernel)
        if wallfacer_groups is None
        else WallFacerAttention(wallfacer_groups, comm=comm, kernel=kernel, sharding=sharding)
    )
    if ulysses_group is None:
        return inner
    return UlyssesAttention(group=ulysses_group, inner=inner, comm=comm, check_group=sp_group)
