"""Where a mixer layer's pieces sit (``MixerShards``) and how a layer is recognised by the expression in its code;
shared by ``short_convs.py`` and ``delta_nets.py`` (``mixer_layers.py`` attaches them)."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import nn

from ..attention.documents import SequenceBatch
from ..comm import CommLayer
from ..mixers import ChunkRing

__all__ = ["ATTR", "MixerInputs", "MixerShards", "has_form", "shards_of"]

ATTR = "_wallfacer_mixer"


@dataclass
class MixerInputs:
    """This forward's batch structure, for the mixer layers: set by ``SequenceParallelCausalLM.attention_kwargs`` at
    every forward, so it reaches layers of models whose forward does not pass keywords down (Mamba-2's does not)."""

    batch: SequenceBatch | None = None
    """Packed documents and a balanced assignment (None: one sequence per row, the layout's sharding)."""
    positions: torch.Tensor | None = None
    """This rank's position ids [B, S_l] (inside their documents)."""

    @property
    def packed(self) -> bool:
        return self.batch is not None and self.batch.documents is not None


@dataclass(frozen=True)
class MixerShards:
    """What a mixer layer needs to run on this rank's shard: the group, the comm layer, where the pieces are
    (``ChunkRing``'s fields; a balanced batch brings its own assignment) and who is who in the group."""

    group: dist.ProcessGroup
    comm: CommLayer
    peers: tuple[int, ...]
    """Global ranks of the sequence-parallel group, by shard index (``ParallelDims.shard_index``)."""
    index: int
    """This rank's shard index."""
    sharding: str
    ulysses_degree: int
    group_shards: tuple[int, ...]
    """The shard index of each rank of ``group``, in group order."""
    group_rank: int
    """This rank's place in ``group``."""
    inputs: MixerInputs
    """The current forward's batch structure (shared with the loss module, which sets it)."""

    def ring(self, batch: SequenceBatch | None) -> ChunkRing:
        assignment = batch.assignment if batch is not None else None
        return _ring(self.peers, self.index, self.sharding, self.ulysses_degree, assignment)


@lru_cache(maxsize=64)
def _ring(peers: tuple[int, ...], index: int, sharding: str, ulysses_degree: int,
          assignment: tuple[tuple[int, ...], ...] | None) -> ChunkRing:
    return ChunkRing(peers=peers, index=index, sharding=sharding, ulysses_degree=ulysses_degree, assignment=assignment)


@lru_cache(maxsize=None)
def has_form(cls: type, patterns: tuple[re.Pattern, ...]) -> bool:
    """Whether ``cls.forward``'s source matches every pattern (the expression a sharded forward reproduces)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return all(p.search(src) for p in patterns)


def shards_of(m: nn.Module) -> MixerShards:
    """The ``MixerShards`` ``attach_mixers`` gave layer ``m``."""
    return m.__dict__[ATTR]
