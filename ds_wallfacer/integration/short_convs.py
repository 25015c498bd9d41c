"""LFM2's short-convolution layers (``Lfm2ShortConv`` and its copies in LFM2-MoE and LFM3) on sequence shards.

The layer is ``out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(h)`` and a causal depthwise convolution
``conv`` of kernel K. Everything but ``conv`` is position-wise, so on a shard only the convolution changes: it
becomes ``mixers.sharded_causal_conv1d`` (each piece receives the previous piece's last K - 1 inputs). transformers
calls the convolution as a free function inside ``forward``, with no hook to take it over, so ``attach`` gives each
recognised layer a forward of its own that computes the same expression with the sharded convolution; the class and
its other instances stay untouched. A layer is recognised by what it is built from (children, shapes, the
convolution's padding) and by the expression in its code; the start-up self-check then compares it with the
model's own forward on one sequence, so a future transformers that changes the layer is refused, not trained wrong.

Design: Note [Short convolutions on shards] in docs/design.md §11.
"""
from __future__ import annotations

import contextlib
import inspect
import re
import types
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..attention.documents import SequenceBatch
from ..comm import CommLayer
from ..mixers import ChunkRing, sharded_causal_conv1d
from .hf import BATCH_KWARG
from .positional import POSITIONS_KWARG

__all__ = ["ShortConvShards", "attach_short_convs", "is_short_conv", "model_forwards", "short_conv_layers"]

_ATTR = "_wallfacer_short_conv"
_FORM = (re.compile(r"\bB\s*,\s*C\s*,\s*x\s*=\s*BCx\.chunk\(\s*3\s*,\s*dim\s*=\s*-2\s*\)"),
         re.compile(r"\bB\s*\*\s*x\b"), re.compile(r"\bC\s*\*\s*hidden_states\b"),
         re.compile(r"\bcausal_conv1d_fn\(\s*hidden_states\s*,\s*self\.conv\.weight\.squeeze\(1\)\s*,\s*self\.conv"
                    r"\.bias"))
"""The expression of the layer's forward: in_proj split three ways, B * x convolved, C times the result."""


@lru_cache(maxsize=None)
def _has_the_form(cls: type) -> bool:
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return all(p.search(src) for p in _FORM)


def is_short_conv(m: nn.Module) -> bool:
    """Whether ``m`` is LFM2's gated short convolution: children ``in_proj`` (D -> 3D), a depthwise causal ``conv``
    (D channels, kernel K, padding K - 1, stride and dilation 1) and ``out_proj`` (D -> D), and that expression."""
    conv, inp, out = (getattr(m, n, None) for n in ("conv", "in_proj", "out_proj"))
    if not (isinstance(conv, nn.Conv1d) and isinstance(inp, nn.Linear) and isinstance(out, nn.Linear)):
        return False
    if {n for n, _ in m.named_children()} != {"conv", "in_proj", "out_proj"}:
        return False
    d, k = conv.in_channels, conv.kernel_size[0]
    shapes = (conv.out_channels == d and conv.groups == d and conv.stride == (1,) and conv.dilation == (1,)
              and conv.padding == (k - 1,) and conv.padding_mode == "zeros" and inp.in_features == d
              and inp.out_features == 3 * d and out.in_features == d)
    return shapes and _has_the_form(type(m))


def short_conv_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's recognised short-convolution layers (pure)."""
    return [(n, m) for n, m in model.named_modules() if is_short_conv(m)]


@dataclass(frozen=True)
class ShortConvShards:
    """What a short-convolution layer needs to run on this rank's shard: the group, the comm layer, and where the
    pieces are (``ChunkRing``'s fields; a balanced batch brings its own assignment)."""

    group: dist.ProcessGroup
    comm: CommLayer
    peers: tuple[int, ...]
    """Global ranks of the sequence-parallel group, by shard index (``ParallelDims.shard_index``)."""
    index: int
    """This rank's shard index."""
    sharding: str
    ulysses_degree: int

    def ring(self, batch: SequenceBatch | None) -> ChunkRing:
        assignment = batch.assignment if batch is not None else None
        return _ring(self.peers, self.index, self.sharding, self.ulysses_degree, assignment)


@lru_cache(maxsize=64)
def _ring(peers: tuple[int, ...], index: int, sharding: str, ulysses_degree: int,
          assignment: tuple[tuple[int, ...], ...] | None) -> ChunkRing:
    return ChunkRing(peers=peers, index=index, sharding=sharding, ulysses_degree=ulysses_degree, assignment=assignment)


def _sharded_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                     attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The layer's forward on this rank's shard (hidden_states [B, S_l, D])."""
    shards: ShortConvShards = self.__dict__[_ATTR]
    if cache is not None or attention_mask is not None:
        what = "a generation cache" if cache is not None else "an attention mask"
        raise ValueError(f"{type(self).__name__} got {what} under sequence parallelism; only training on right-padded "
                         "sequences from the sequence-parallel loader is supported")
    batch: SequenceBatch | None = kwargs.get(BATCH_KWARG)
    positions = kwargs.get(POSITIONS_KWARG)
    packed = batch is not None and batch.documents is not None
    if packed and positions is None:
        raise ValueError(f"{type(self).__name__}: a packed batch reached the layer without its positions; build the "
                         "model with ds_wallfacer.integration.initialize, which passes them")
    bcx = self.in_proj(hidden_states).transpose(-1, -2)
    b_gate, c_gate, x = bcx.chunk(3, dim=-2)
    y = sharded_causal_conv1d(b_gate * x, self.conv.weight.squeeze(1), self.conv.bias,
                              positions=None, ring=shards.ring(batch),
                              comm=shards.comm, group=shards.group)
    return self.out_proj((c_gate * y).transpose(-1, -2).contiguous())


def attach_short_convs(model: nn.Module, shards: ShortConvShards) -> list[str]:
    """Give every recognised short-convolution layer the sharded forward; returns their names. Under ZeRO-3 the
    convolution's parameters are registered with the layer (the layer reads them without calling ``conv``)."""
    layers = short_conv_layers(model)
    for _, m in layers:
        m.__dict__[_ATTR] = shards
        m.forward = types.MethodType(_sharded_forward, m)
        _register_external(m)
    return [n for n, _ in layers]


def _register_external(m: nn.Module) -> None:
    params = [p for p in m.conv.parameters() if hasattr(p, "ds_id")]
    if params:
        from deepspeed.zero import register_external_parameter

        for p in params:
            register_external_parameter(m, p)


@contextlib.contextmanager
def model_forwards(model: nn.Module) -> Iterator[None]:
    """The layers' own forwards for a while (the self-check's reference run)."""
    layers = [m for _, m in short_conv_layers(model) if "forward" in m.__dict__]
    saved = [m.__dict__.pop("forward") for m in layers]
    try:
        yield
    finally:
        for m, f in zip(layers, saved):
            m.forward = f
