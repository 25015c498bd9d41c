"""Sequence sharding of tensors: full sequence <-> a rank's two chunks, and global position ids.

Which chunks a rank holds is ``chunks.py`` (pure); the block schedule over those chunks is
``attention/schedule.py``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .chunks import SCHEMES, check_divisible, chunk_ids

__all__ = ["SCHEMES", "check_divisible", "chunk_ids", "position_ids", "shard", "unshard"]


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
