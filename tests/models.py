"""The one tiny-model builder of the tests: 2-layer, hidden-64 HF causal LMs built from config (no downloads),
fp32, train mode, deterministic weights. Test folders choose their sizes through keyword overrides."""
from __future__ import annotations

import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

__all__ = ["FAMILIES", "TINY_CONFIG", "tiny_model"]

FAMILIES = ("llama", "qwen2", "mistral", "gemma2")
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    attn_implementation="sdpa",
)


def tiny_model(family: str, *, seed: int = 0, tie: bool = False, **overrides) -> torch.nn.Module:
    """A model of ``family`` (``FAMILIES``): 4 query / 2 kv heads; ``overrides`` replace config fields."""
    torch.manual_seed(seed)
    kw = {**TINY_CONFIG, **overrides, "tie_word_embeddings": tie}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**kw))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**kw))  # q/k/v biases: exercised too
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**kw, sliding_window=None))
    elif family == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(**{**kw, "tie_word_embeddings": True}, head_dim=16,
                                               final_logit_softcapping=5.0))
    else:
        raise ValueError(f"unknown family {family!r}; expected one of {FAMILIES}")
    return model.train()
