"""The hybrid: Ulysses degree U inside (consecutive ranks, one node) x WallFacer over R = P / U ring ranks outside.
``sequence_parallel_attention`` returns this rank's attention for any mode: U = 1 is WallFacer alone, R = 1 Ulysses
alone, neither (P = 1) local attention.

Design: Note [Hybrid sequence order] in docs/design/layouts.md (which pieces each rank holds, bytes sent).
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
    ulysses_head_groups: int = 2,
) -> InnerAttention:
    """This rank's attention for any mode: Ulysses over ``ulysses_group`` (None: U = 1) around WallFacer over
    ``wallfacer_groups`` (None: R = 1, attention over the gathered sequence is local). Neither (P = 1: one
    rank per sequence, plain data parallelism or a single GPU) is local attention with the same kernels and no
    collective at all. ``sp_group``: all ranks of the sequence, whose inputs Ulysses checks agree (None: the
    Ulysses group only); ``ulysses_head_groups``: ``UlyssesAttention.head_groups``."""
    inner: InnerAttention = (
        LocalAttention(kernel=kernel)
        if wallfacer_groups is None
        else WallFacerAttention(wallfacer_groups, comm=comm, kernel=kernel, sharding=sharding)
    )
    if ulysses_group is None:
        return inner
    return UlyssesAttention(group=ulysses_group, inner=inner, comm=comm, check_group=sp_group,
                            head_groups=ulysses_head_groups)
