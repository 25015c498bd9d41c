"""Tiny HF causal LMs built from config (no downloads) for the MsT tests."""
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

VOCAB = 160
_COMMON = dict(
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    attn_implementation="eager",
)


def tiny_model(kind: str, *, seed: int = 0, tie: bool = False) -> torch.nn.Module:
    """A 2-layer, hidden-64 model of the given family, fp32, train mode, deterministic weights."""
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_COMMON, tie_word_embeddings=tie))
    elif kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_COMMON, tie_word_embeddings=tie))
    elif kind == "mistral":
        model = MistralForCausalLM(MistralConfig(**_COMMON, tie_word_embeddings=tie, sliding_window=None))
    elif kind == "gemma2":
        model = Gemma2ForCausalLM(
            Gemma2Config(**_COMMON, head_dim=16, final_logit_softcapping=5.0, tie_word_embeddings=True)
        )
    else:
        raise ValueError(kind)
    return model.train()


def batch(seq_len: int, *, batch_size: int = 1, seed: int = 0, pad_from: int | None = None):
    """(input_ids, labels) with HF (unshifted) labels; positions >= pad_from are padding (-100)."""
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)
    labels = ids.clone()
    if pad_from is not None:
        labels[:, pad_from:] = -100
    return ids, labels


def hf_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reference: the model's own forward with full logits and HF's loss."""
    return model(input_ids=ids, labels=labels).loss
