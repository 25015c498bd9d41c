"""Vision-language models: images and videos inside a sequence-parallel row; which adapter a model gets.

The language model of a VLM is sharded like any text model; what the images add is computed on the full row first
and then cut with the tokens. Two adapters do that: ``mrope_vision.MropeVisionLanguage`` for the M-RoPE families
(Qwen-VL, Qwen3.5, GLM-4V, the Omni thinkers, ...: 3-D positions from the model's own rope index on the full row,
per document; the tower's work split by frames) and ``placeholder_vision.PlaceholderVisionLanguage`` for every
class whose code merges images by placeholder tokens with 1-D positions.

Only the families checked exact are adapted (``ADAPTED``, and the placeholder pattern recognised from the class's
code); any other model with a vision tower gets a batch with pixels refused with the reason (``media_refusal``).
Design: Note [Images in a sequence-parallel row] in docs/design/documents.md.
"""
from __future__ import annotations

from typing import Any, NoReturn

import torch
from torch import nn

from ..data.media import VisionAdapter
from .media_units import pixel_row
from .mrope_vision import FAMILIES, FrameUnit, MropeVisionLanguage, frame_units, mrope_misses, split_units
from .placeholder_forms import PlaceholderForm, placeholder_form
from .placeholder_vision import PlaceholderVisionLanguage

__all__ = ["ADAPTED", "FrameUnit", "QwenVisionLanguage", "RefusedVision", "frame_units", "has_vision_tower",
           "media_refusal", "pixel_row", "runs_images", "split_units", "vision_language"]

ADAPTED = {name: family.model_type for name, family in FAMILIES.items()}
"""The M-RoPE classes (``mrope_vision.FAMILIES``: positions from the model's own rope index, ``MropeVisionLanguage``),
checked exact by the sweep. Every other class with the placeholder pattern is recognised from its code
(``placeholder_vision.py``)."""

QwenVisionLanguage = MropeVisionLanguage
"""The Qwen-VL adapter's former name: the M-RoPE adapter runs Qwen-VL as one of its families."""

_REFUSED = {
    "Gemma3nForConditionalGeneration": "its image and audio tokens attend bidirectionally, like Gemma 3",
}


def has_vision_tower(model: nn.Module) -> bool:
    """Whether the model takes images (or audio): a vision or audio config next to its language model, or a forward
    that takes ``pixel_values``."""
    import inspect

    cfg = getattr(model, "config", None)
    if any(getattr(cfg, k, None) is not None for k in ("vision_config", "audio_config", "vision_tower_config")):
        return True
    forward = getattr(model, "forward", None)
    try:
        return forward is not None and "pixel_values" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def media_refusal(model: nn.Module, why: str | None = None) -> str:
    """Why this model's batches with pixels are refused (a model without an adapter); ``why``: what its forward
    does that no adapter reproduces (``placeholder_form``'s answer)."""
    name = type(model).__name__
    why = _REFUSED.get(name) or why or "ds_wallfacer has no adapter that places its image features on shards"
    return (f"{name}: batches with images or videos are not supported under sequence parallelism: {why}. Train it on "
            "text only, or a model whose images train on shards (docs/models.md, the multimodal table)")


class RefusedVision:
    """A model with a vision tower but no adapter (a ``VisionAdapter`` that refuses): a batch with pixels raises
    ``refusal``; text batches train as a text model's, and the self-check runs text."""

    def __init__(self, refusal: str) -> None:
        self.refusal = refusal

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ValueError(self.refusal)

    token_types = positions = media_index = inputs = _refuse  # any batch with pixels: the reason, not a crash

    def sample(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"input_ids": ids}


def vision_language(model: nn.Module) -> VisionAdapter | None:
    """The adapter of an HF vision-language model: ``MropeVisionLanguage`` (``ADAPTED``, unless the class lacks its
    family's pattern), else ``PlaceholderVisionLanguage`` for a model whose code has the placeholder pattern;
    ``RefusedVision`` for one with a vision tower and neither (saying what its forward does); None for a text
    model."""
    name = type(model).__name__
    if name in ADAPTED:
        miss = mrope_misses(model, FAMILIES[name])
        return MropeVisionLanguage(model) if miss is None else RefusedVision(media_refusal(model, miss))
    if not has_vision_tower(model):
        return None
    form = placeholder_form(model) if name not in _REFUSED else None
    if isinstance(form, PlaceholderForm):
        return PlaceholderVisionLanguage(model, form)
    return RefusedVision(media_refusal(model, form))


def runs_images(model: nn.Module) -> bool:
    """Whether the model's images run on shards with an adapter (its tower then keeps its own attention)."""
    return isinstance(vision_language(model), (MropeVisionLanguage, PlaceholderVisionLanguage))
