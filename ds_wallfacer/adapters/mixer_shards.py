"""What the mixer layers (``short_convs.py``, ``delta_nets.py``, ``mamba_mixers.py``; ``mixer_layers.py`` attaches
them) share: where their pieces sit (``MixerShards``, ``MixerInputs``), how a layer is recognised by the expression
in its code and its causal depthwise convolution, and how a head-parallel layer runs the model's own convolution
and scan per document."""
from __future__ import annotations

import inspect
import re
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..attention.documents import SequenceBatch
from ..comm import CommLayer
from ..mixers import ChunkRing, gather_heads, scatter_heads

__all__ = ["ATTR", "CONV_HELPER", "Form", "HeadParallelCall", "MixerInputs", "MixerShards", "causal_depthwise",
           "closest_misses", "conv_call", "convolve_channels", "family_misses", "first_family", "form_misses", "has_form",
           "head_parallel_call", "per_document", "refuse_cache", "runs_of", "shards_of"]

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


@dataclass(frozen=True)
class Form:
    """An expression a sharded forward reproduces, as one transformers release writes it: patterns the class's
    ``forward`` source matches and, for each function of the model's module the forward calls in place of a kernel
    (from transformers 5.25 the cache-aware helpers ``causal_conv1d_forward`` and ``mamba2_scan_forward``), the
    patterns that function's source matches (that without a cache it is the kernel the sharded forward calls).
    Note [Forms per transformers release] in docs/design/mixers.md."""

    forward: tuple[re.Pattern, ...]
    helpers: tuple[tuple[str, tuple[re.Pattern, ...]], ...] = ()


def _plain_function(obj: Any) -> Any:
    """The Python function behind ``obj``: itself, or the function a kernel-hub wrapper calls when no kernel was
    chosen (``kernels``' ``use_kernel_forward_from_hub`` turns a function into a module whose forward calls it)."""
    if inspect.isfunction(obj):
        return inspect.unwrap(obj)
    forward = getattr(type(obj), "forward", None)
    if inspect.isfunction(forward):
        inner = inspect.getclosurevars(forward).nonlocals.get("func")
        if inspect.isfunction(inner):
            return inspect.unwrap(inner)
    return None


def _source(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def form_misses(cls: type, form: Form) -> list[str]:
    """What of ``form`` ``cls`` does not match: each missing pattern as ``where: pattern`` (``forward``, or the
    helper's name), so a refusal can say which recogniser stopped matching. Empty: ``cls`` has the form."""
    module = sys.modules.get(cls.__module__)
    parts = [("forward", _source(cls.forward), form.forward)]
    parts += [(name, _source(_plain_function(getattr(module, name, None))), pats) for name, pats in form.helpers]
    return [f"{where}: {p.pattern}" for where, src, pats in parts for p in pats if not p.search(src)]


def has_form(cls: type, forms: tuple[Form, ...]) -> bool:
    """Whether ``cls`` has one of ``forms`` (one per transformers release that wrote the layer differently)."""
    return not closest_misses(cls, forms)


@lru_cache(maxsize=None)
def closest_misses(cls: type, forms: tuple[Form, ...]) -> tuple[str, ...]:
    """``form_misses`` of the form ``cls`` comes closest to; () when ``cls`` has one of ``forms``."""
    return tuple(min((form_misses(cls, f) for f in forms), key=len, default=[]))


def conv_call(x: str, conv: str, *, activation: bool, keywords: bool = False) -> tuple[re.Pattern, re.Pattern]:
    """The layer's causal depthwise convolution of ``x`` by ``self.<conv>`` (with ``activation=self.activation``
    when ``activation``), as transformers <= 5.24 calls the kernel (``causal_conv1d_fn``, weight and bias passed by
    keyword when ``keywords``) and as 5.25 calls the cache-aware helper (``causal_conv1d_forward``, whose form is
    ``CONV_HELPER``)."""
    act = r"\s*,\s*activation\s*=\s*self\.activation" if activation else r"(?!\s*,\s*activation)"
    kw_w, kw_b = (r"weight\s*=\s*", r"bias\s*=\s*") if keywords else ("", "")
    kernel = re.compile(r"\bcausal_conv1d_fn\(\s*" + x + r"\s*,\s*" + kw_w + r"self\." + conv
                        + r"\.weight\.squeeze\(1\)\s*,\s*" + kw_b + r"self\." + conv + r"\.bias" + act)
    helper = re.compile(r"\bcausal_conv1d_forward\(\s*self\." + conv + r"\s*,\s*" + x
                        + r"\s*,\s*cache\s*,\s*self\.layer_idx" + (act if activation else r"\s*,\s*\*\*kwargs\s*\)"))
    return kernel, helper


CONV_HELPER = ("causal_conv1d_forward", (
    re.compile(r"\bconv_state\s*=\s*cache\.get_conv_state\([^)]*\)\s*if\s+cache\s+is\s+not\s+None\s+else\s+None"),
    re.compile(r"\bweight\s*=\s*conv1d\.weight\.squeeze\(1\)"),
    re.compile(r"\bif\s+conv_state\s+is\s+not\s+None\s+and\s+seq_len\s*==\s*1"),
    re.compile(r"\bif\s+cache\s+is\s+not\s+None\s*:\s*hidden_states\s*=\s*cache\.update_conv_state\("),
    re.compile(r"\bhidden_states\s*=\s*causal_conv1d_fn\(\s*hidden_states\s*,\s*weight\s*,\s*conv1d\.bias\s*,\s*"
               r"activation\s*=\s*activation\b"),
))
"""transformers 5.25's ``causal_conv1d_forward`` without a cache: the kernel ``causal_conv1d_fn`` on the layer's
weight and bias with the given activation (a cache adds its conv state, which sharded layers refuse)."""


def first_family(cls: type, families: list) -> Any:
    """The first of ``families`` (each with its ``forms``) whose form ``cls`` has, else None."""
    return next((f for f in families if has_form(cls, f.forms)), None)


def family_misses(cls: type, families: list) -> tuple[str, ...] | None:
    """None when no family fits the layer's parts (``families`` empty); else ``closest_misses`` over them: () when
    ``cls`` has one of their forms."""
    if not families:
        return None
    return min((closest_misses(cls, f.forms) for f in families), key=len)


@dataclass(frozen=True)
class HeadParallelCall:
    """One call of a head-parallel sharded forward (gated delta-nets, Mamba-2): the model's module (its own
    convolution and scan functions), where the pieces are, this rank's place among the P ranks, and the documents."""

    shards: MixerShards
    model_code: Any
    """The module of the layer's class: ``causal_conv1d_fn``, the scan."""
    ring: ChunkRing
    runs: list[list[tuple[int, int]]] | None
    """Per row, the documents' [start, end) (``runs_of``); None: one sequence per row."""
    p: int
    """Ranks of the group; each scans 1 / P of the heads."""
    j: int
    """This rank's place in the group: its heads are the j-th P-th."""

    def gather(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """[B, S_l, H, ...] shards -> every token of this rank's H / P heads (``mixers.gather_heads``)."""
        sh = self.shards
        return gather_heads(xs, ring=self.ring, group_shards=sh.group_shards, group=sh.group, comm=sh.comm)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """[B, N, H / P, ...] -> this rank's shard of every head (``mixers.scatter_heads``)."""
        sh = self.shards
        return scatter_heads(y, ring=self.ring, group_shards=sh.group_shards, group=sh.group, comm=sh.comm)


def head_parallel_call(m: nn.Module, cache: Any, attention_mask: Any) -> HeadParallelCall:
    """The start of a head-parallel sharded forward: refuse a cache or a mask, then where this call's pieces are."""
    refuse_cache(m, cache, attention_mask)
    shards = shards_of(m)
    batch = shards.inputs.batch
    return HeadParallelCall(shards=shards, model_code=sys.modules[type(m).__module__], ring=shards.ring(batch),
                            runs=runs_of(batch), p=len(shards.group_shards), j=shards.group_rank)


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
