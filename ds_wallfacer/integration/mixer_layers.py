"""Sequence mixers other than attention, run on shards: LFM2's short convolutions (``short_convs.py``) and gated
delta-nets (``delta_nets.py``).

transformers computes these layers with free functions called inside ``forward`` (a convolution, a chunked scan),
with no hook to take them over, so each recognised layer gets a forward of its own: an instance attribute, the
class and its other instances untouched, computing the layer's expression with the sharded operator. A layer is
recognised by what it is built from (children, shapes) and by the expression in its code; the start-up self-check
then compares it with the model's own forward on one sequence (``model_forwards``), so a transformers release that
changes the layer is refused, not trained wrong.

Design: Note [Layers that mix along the sequence, on shards] in docs/design.md §11.
"""
from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterator

from torch import nn

from . import delta_nets, mamba_mixers, short_convs
from .mixer_shards import ATTR, MixerShards

__all__ = ["MixerShards", "attach_mixers", "mixer_head_counts", "mixer_layers", "model_forwards"]

def _no_check(name: str, m: nn.Module, *, sp_size: int) -> None:
    """Short convolutions run on any number of ranks (the operator checks the piece length)."""


_KINDS: tuple[tuple[Callable, Callable, Callable, Callable], ...] = (
    (short_convs.is_short_conv, short_convs.sharded_forward, short_convs.read_parameters, _no_check),
    (delta_nets.is_delta_net, delta_nets.sharded_forward, delta_nets.read_parameters, delta_nets.check_heads),
    (mamba_mixers.is_mamba_mixer, mamba_mixers.sharded_forward, mamba_mixers.read_parameters,
     mamba_mixers.check_heads),
)
"""(recognise, the sharded forward, the parameters the forward reads without calling their module, the check of
the number of ranks) per kind of layer."""


def _kind(m: nn.Module):
    return next((k for k in _KINDS if k[0](m)), None)


def mixer_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's recognised mixer layers (pure)."""
    return [(n, m) for n, m in model.named_modules() if _kind(m) is not None]


def attach_mixers(model: nn.Module, shards: MixerShards) -> list[str]:
    """Give every recognised mixer layer its sharded forward; returns their names. Raises when a layer cannot run
    on this many ranks (e.g. heads that do not divide by P). Under ZeRO-3 the parameters a forward reads without
    calling their module are registered with the layer."""
    layers = mixer_layers(model)
    for name, m in layers:
        _kind(m)[3](name, m, sp_size=len(shards.peers))
    for _, m in layers:
        _, forward, reads, _ = _kind(m)
        m.__dict__[ATTR] = shards
        m.forward = types.MethodType(forward, m)
        partitioned = [p for p in reads(m) if hasattr(p, "ds_id")]
        if partitioned:
            from deepspeed.zero import register_external_parameter

            for p in partitioned:
                register_external_parameter(m, p)
    return [n for n, _ in layers]


def mixer_head_counts(model: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head counts that P must divide, Mamba-2 group counts that must divide P or be divisible by it) of the
    model's head-parallel layers: what the planner needs to choose a P they run on."""
    heads: set[int] = set()
    groups: set[int] = set()
    for _, m in mixer_layers(model):
        if delta_nets.is_delta_net(m):
            heads |= {int(m.num_k_heads), int(m.num_v_heads)}
        elif mamba_mixers.is_mamba_mixer(m):
            heads.add(int(m.num_heads))
            groups.add(int(m.n_groups))
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
