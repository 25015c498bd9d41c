"""Sequence mixers other than attention, run on shards: LFM2's short convolutions (``short_convs.py``), gated
delta-nets (``delta_nets.py``) and Mamba-2 mixers (``mamba_mixers.py``).

transformers computes these layers with free functions called inside ``forward`` (a convolution, a chunked scan),
with no hook to take them over, so each recognised layer gets a forward of its own: an instance attribute, the
class and its other instances untouched, computing the layer's expression with the sharded operator. A layer is
recognised by what it is built from (children, shapes) and by the expression in its code; the start-up self-check
then compares it with the model's own forward on one sequence (``model_forwards``), so a transformers release that
changes the layer is refused, not trained wrong.

Design: Note [Layers that mix along the sequence, on shards] in docs/design/mixers.md.
"""
from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterator, NamedTuple

from torch import nn

from ..comm.dims import splits_heads
from . import delta_nets, mamba_mixers, short_convs
from .mixer_shards import ATTR, MixerShards

__all__ = ["MixerShards", "attach_mixers", "mixer_head_counts", "mixer_layers", "model_forwards", "near_misses"]


class _Kind(NamedTuple):
    """One kind of mixer layer, as its module provides it."""

    name: str
    misses: Callable[[nn.Module], tuple[str, ...] | None]
    """None: not built like this kind; (): recognised; else what the forward misses of the closest known form."""
    forward: Callable
    """The sharded forward."""
    reads: Callable[[nn.Module], list[nn.Parameter]]
    """The parameters the forward reads without calling their module."""
    head_counts: Callable[[nn.Module], tuple[tuple[int, ...], tuple[int, ...]]]
    """(counts P must divide, counts that must divide P or be divisible by it): ``comm.dims.splits_heads``."""
    settings: str
    """What those counts are, in the user's words."""


_KINDS = (
    _Kind("LFM2 gated short convolution", short_convs.form_misses, short_convs.sharded_forward, short_convs.read_parameters,
          short_convs.head_counts, ""),
    _Kind("gated delta-net", delta_nets.form_misses, delta_nets.sharded_forward, delta_nets.read_parameters, delta_nets.head_counts,
          delta_nets.SETTINGS),
    _Kind("Mamba-2 mixer", mamba_mixers.form_misses, mamba_mixers.sharded_forward, mamba_mixers.read_parameters,
          mamba_mixers.head_counts, mamba_mixers.SETTINGS),
)


def _kind(m: nn.Module) -> _Kind | None:
    return next((k for k in _KINDS if k.misses(m) == ()), None)


def _layers(model: nn.Module) -> list[tuple[str, nn.Module, _Kind]]:
    return [(n, m, k) for n, m in model.named_modules() if (k := _kind(m)) is not None]


def mixer_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's recognised mixer layers (pure)."""
    return [(n, m) for n, m, _ in _layers(model)]


def near_misses(model: nn.Module) -> list[tuple[str, str, tuple[str, ...]]]:
    """(name, kind, what its forward misses) of each layer built like a mixer kind whose forward matches none of the
    forms this package knows (e.g. a transformers release rewrote it): the recogniser that stopped matching, for
    the refusal and the sweep to name (pure)."""
    out = []
    for n, m in model.named_modules():
        found = [(k.name, miss) for k in _KINDS if (miss := k.misses(m)) is not None]
        if found and all(miss for _, miss in found):  # built like some kind, recognised as none
            out.append((n, *min(found, key=lambda f: len(f[1]))))
    return out


def attach_mixers(model: nn.Module, shards: MixerShards) -> list[str]:
    """Give every recognised mixer layer its sharded forward; returns their names. Raises when a layer cannot run
    on this many ranks (e.g. heads that do not divide by P). Under ZeRO-3 the parameters a forward reads without
    calling their module are registered with the layer."""
    p = len(shards.peers)
    layers = _layers(model)
    for name, m, kind in layers:  # every layer checked before any is changed
        heads, groups = kind.head_counts(m)
        if not splits_heads(p, heads, groups):
            grouped = f" in groups {list(groups)}" if groups else ""
            rule = "divides the heads" + (", and divides or is a multiple of the groups" if groups else "")
            raise ValueError(
                f"{name} ({type(m).__name__}): its heads {list(heads)}{grouped} cannot be split over {p} "
                f"sequence-parallel ranks, which scan whole heads each: use a sequence_parallel_size that splits "
                f"{kind.settings} ({rule})")
    for _, m, kind in layers:
        m.__dict__[ATTR] = shards
        m.forward = types.MethodType(kind.forward, m)
        partitioned = [q for q in kind.reads(m) if hasattr(q, "ds_id")]
        if partitioned:
            from deepspeed.zero import register_external_parameter

            for q in partitioned:
                register_external_parameter(m, q)
    return [n for n, _, _ in layers]


def mixer_head_counts(model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head counts that P must divide, Mamba-2 group counts that must divide P or be divisible by it) of the
    model's head-parallel layers: what the planner needs to choose a P they run on."""
    heads: set[int] = set()
    groups: set[int] = set()
    for _, m, kind in _layers(model):
        h, g = kind.head_counts(m)
        heads |= set(h)
        groups |= set(g)
    return tuple(sorted(heads)), tuple(sorted(groups))


@contextlib.contextmanager
def model_forwards(model: nn.Module) -> Iterator[None]:
    """The layers' own forwards for a while (the self-check's reference run)."""
    layers = [m for _, m in mixer_layers(model) if "forward" in m.__dict__]
    saved = [m.__dict__.pop("forward") for m in layers]
    try:
        yield
    finally:
        for m, f in zip(layers, saved):
            m.forward = f
