"""What the mixer layers (``short_convs.py``, ``delta_nets.py``, ``mamba_mixers.py``; ``mixer_layers.py`` attaches
them) share: where their pieces sit (``MixerShards``, ``MixerInputs``), how a layer is recognised by the expression
in its code and its causal depthwise convolution, and how a head-parallel layer runs the model's own convolution
and scan per document."""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..attention.documents import SequenceBatch
from ..comm import CommLayer
from ..mixers import ChunkRing

__all__ = ["ATTR", "MixerInputs", "MixerShards", "causal_depthwise", "convolve_channels", "has_form", "per_document",
           "refuse_cache", "runs_of", "shards_of"]

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


def causal_depthwise(conv: Any, channels: int | None = None) -> bool:
    """Whether ``conv`` is a depthwise causal Conv1d (padding K - 1, stride and dilation 1), of ``channels``."""
    if not isinstance(conv, nn.Conv1d):
        return False
    d, k = conv.in_channels, conv.kernel_size[0]
    return (conv.out_channels == d and conv.groups == d and conv.stride == (1,) and conv.dilation == (1,)
            and conv.padding == (k - 1,) and conv.padding_mode == "zeros" and channels in (None, d))


def refuse_cache(m: nn.Module, cache: Any, attention_mask: Any) -> None:
    if cache is not None or attention_mask is not None:
        what = "a generation cache" if cache is not None else "an attention mask"
        raise ValueError(f"{type(m).__name__} got {what} under sequence parallelism; only training on right-padded "
                         "sequences from the sequence-parallel loader is supported")


def runs_of(batch: SequenceBatch | None) -> list[list[tuple[int, int]]] | None:
    """Per row, the [start, end) of each document; None when every row is one sequence."""
    if batch is None or batch.documents is None:
        return None
    docs = batch.documents
    return [list(zip(starts, (*starts[1:], docs.seq_len))) for starts in docs.starts]


def per_document(fn: Callable[..., torch.Tensor], runs: list[list[tuple[int, int]]] | None, dim: int,
                  *xs: torch.Tensor) -> torch.Tensor:
    """``fn`` over each document of each row (``xs`` cut along ``dim``, rows along dim 0), joined back."""
    if runs is None:
        return fn(*xs)
    rows = []
    for r, spans in enumerate(runs):
        rows.append(torch.cat([fn(*(x[r:r + 1].narrow(dim, s, e - s) for x in xs)) for s, e in spans], dim=dim))
    return torch.cat(rows, dim=0)


def convolve_channels(m: nn.Module, model_code: Any, x: torch.Tensor, spans: list[tuple[int, int]],
                      runs: list[list[tuple[int, int]]] | None) -> torch.Tensor:
    """x [B, N, C_j]: channels ``spans`` ([start, end) ranges, in order) of ``m.conv1d`` over the whole sequence ->
    the model's own causal convolution and activation of them (``causal_conv1d_fn``), per document."""
    chans = torch.cat([torch.arange(lo, hi) for lo, hi in spans]).to(x.device)
    weight = m.conv1d.weight.squeeze(1).index_select(0, chans)
    bias = None if m.conv1d.bias is None else m.conv1d.bias.index_select(0, chans)
    out = per_document(lambda t: model_code.causal_conv1d_fn(t, weight, bias, activation=m.activation), runs, 2,
                       x.transpose(1, 2))
    return out.transpose(1, 2)
