"""The adapters' start-up step: an HF model made to run on sequence shards in place, in one call
(``apply_sequence_parallel``): this rank's attention on its attention layers (``hf.py``), the sharded forwards of its
other mixer layers (``mixer_layers.py``), the global length for the rotary embeddings that read it (``rope.py``), and
a vision-language model's adapter (``vision.py``). What it leaves for each forward is an ``AdaptedModel``."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..attention.ulysses import InnerAttention
from ..data.media import VisionAdapter
from . import positional
from .hf import attach, attention_modules
from .mixer_layers import attach_mixers
from .mixer_shards import MixerShards
from .rope import RopeLength, wrap_rotary
from .vision import vision_language

__all__ = ["AdaptedModel", "apply_sequence_parallel"]


@dataclass(frozen=True)
class AdaptedModel:
    """What ``apply_sequence_parallel`` leaves for the loss module to drive in each forward."""

    mixing: MixerShards | None
    """The shards the model's mixer layers other than attention read (``mixer_layers.py``); None: it has none."""
    rope: RopeLength | None
    """The global length shown to rotary embeddings that read it (``rope.py``); None: none does."""
    positions: bool
    """Whether an attention layer scales its queries by position (``positional.POSITIONS_KWARG``)."""
    vision: VisionAdapter | None
    """A vision-language model's images on shards (``vision.py``); None for a text model."""


def apply_sequence_parallel(model: nn.Module, *, attention: InnerAttention, mixing: MixerShards, rotary: list[str],
                            sp_size: int) -> AdaptedModel:
    """The adapters' start-up step: this rank's ``attention`` on every attention layer (``attach``; a pure
    state-space model has none, its mixers are all it needs), the mixer layers' sharded forwards on ``mixing``, and
    the global length for the ``rotary`` modules that read it (the start-up audit's ``ModelAudit.rotary``); a
    vision-language model's adapter."""
    if attention_modules(model):
        attach(model, attention, sp_size=sp_size)
    mixers = attach_mixers(model, mixing)  # convolutions, delta-nets, Mamba-2
    rope = RopeLength()
    wrap_rotary(model, rotary, rope)
    return AdaptedModel(mixing=mixing if mixers else None, rope=rope if rotary else None,
                        positions=any(positional.scales_by_position(m) for _, m in attention_modules(model)),
                        vision=vision_language(model))
