"""The one lookup of an HF model's text config (pure: no torch, no transformers import).

Multimodal configs nest the language model's settings (``config.text_config``); ``PretrainedConfig.get_text_config``
returns that part, and the config itself for text-only models. Everything that reads heads, hidden size, vocabulary,
RoPE or MoE settings asks here.
"""
from __future__ import annotations

from typing import Any

__all__ = ["text_config"]


def text_config(model_or_config: Any) -> Any:
    """The text config of an HF model (its ``.config``) or of an HF config."""
    cfg = getattr(model_or_config, "config", model_or_config)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
