"""The one lookup of an HF model's text config and of its backbone (pure: no torch, no transformers import).

Multimodal configs nest the language model's settings (``config.text_config``); ``PretrainedConfig.get_text_config``
returns that part, and the config itself for text-only models. Everything that reads heads, hidden size, vocabulary,
RoPE or MoE settings asks here. ``backbone``: the decoder whose hidden states the LM head reads.
"""
from __future__ import annotations

from typing import Any

__all__ = ["backbone", "text_config"]


def text_config(model_or_config: Any) -> Any:
    """The text config of an HF model (its ``.config``) or of an HF config."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def backbone(model: Any) -> Any:
    """The model's decoder without its LM head (``get_decoder()``; where that is itself a causal LM with a head, as
    Llama 4's ``language_model`` is, its inner ``model``): what returns the hidden states the head reads."""
    decoder = model.get_decoder()
    if decoder is not model and decoder.get_output_embeddings() is not None:
        inner = decoder.base_model if decoder.base_model is not decoder else getattr(decoder, "model", None)
        return inner if inner is not None else decoder
    return decoder
