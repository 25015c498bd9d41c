"""LFM2's gated short convolutions (``Lfm2ShortConv`` and its copies in LFM2-MoE and LFM3) on sequence shards.

The layer is ``out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(h)`` and a causal depthwise convolution ``conv``
of kernel K. Everything but ``conv`` is position-wise, so on a shard only the convolution changes: it becomes
``mixers.sharded_causal_conv1d`` (each piece receives the previous piece's last K - 1 inputs). Attached by
``mixer_layers.py``.

Design: Note [Short convolutions on shards] in docs/design/mixers.md.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from ..mixers import sharded_causal_conv1d
from .mixer_shards import CONV_HELPER, Form, causal_depthwise, closest_misses, conv_call, refuse_cache, shards_of

__all__ = ["form_misses", "head_counts", "is_short_conv", "read_parameters", "sharded_forward"]

_CORE = (re.compile(r"\bB\s*,\s*C\s*,\s*x\s*=\s*BCx\.chunk\(\s*3\s*,\s*dim\s*=\s*-2\s*\)"),
         re.compile(r"\bB\s*\*\s*x\b"), re.compile(r"\bC\s*\*\s*hidden_states\b"))
_KERNEL, _HELPER = conv_call("hidden_states", "conv", activation=False)
_FORMS = (Form(_CORE + (_KERNEL,)), Form(_CORE + (_HELPER,), (CONV_HELPER,)))
"""The expression of the layer's forward: in_proj split three ways, B * x convolved (no activation), C times the
result; the convolution as transformers <= 5.24 and as 5.25 call it."""


def form_misses(m: nn.Module) -> tuple[str, ...] | None:
    """None: ``m`` is not built like LFM2's gated short convolution (children ``in_proj`` D -> 3D, a depthwise causal
    ``conv`` of D channels, ``out_proj`` D -> D); (): it is, with that expression; else what its forward misses of
    the closest form (``mixer_shards.form_misses``)."""
    conv, inp, out = (getattr(m, n, None) for n in ("conv", "in_proj", "out_proj"))
    if not (causal_depthwise(conv) and isinstance(inp, nn.Linear) and isinstance(out, nn.Linear)):
        return None
    if {n for n, _ in m.named_children()} != {"conv", "in_proj", "out_proj"}:
        return None
    d = conv.in_channels
    if not (inp.in_features == d and inp.out_features == 3 * d and out.in_features == d):
        return None
    return closest_misses(type(m), _FORMS)


def is_short_conv(m: nn.Module) -> bool:
    """Whether ``m`` is LFM2's gated short convolution (``form_misses``)."""
    return form_misses(m) == ()


def read_parameters(m: nn.Module) -> list[nn.Parameter]:
    """The parameters the forward reads without calling their module (the convolution's)."""
    return list(m.conv.parameters())


def head_counts(m: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """No heads to split: a short convolution runs on any number of ranks (the operator checks piece lengths)."""
    return (), ()


def sharded_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                    attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The layer's forward on this rank's shard (hidden_states [B, S_l, D])."""
    refuse_cache(self, cache, attention_mask)
    shards = shards_of(self)
    now = shards.inputs
    bcx = self.in_proj(hidden_states).transpose(-1, -2)
    b_gate, c_gate, x = bcx.chunk(3, dim=-2)
    y = sharded_causal_conv1d(b_gate * x, self.conv.weight.squeeze(1), self.conv.bias,
                              positions=now.positions.to(x.device) if now.packed else None,
                              ring=shards.ring(now.batch),
                              comm=shards.comm, group=shards.group)
    return self.out_proj((c_gate * y).transpose(-1, -2).contiguous())
