"""Tiny HF causal LMs built from config (no downloads) and the non-parallel reference run."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 256
_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    attn_implementation="sdpa",
)
FAMILIES = ("llama", "qwen2", "mistral")


def tiny_model(family: str, *, seed: int = 0) -> torch.nn.Module:
    """A 2-layer, hidden-64, 4 q / 2 kv head model of the given family, fp32, train mode."""
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**_COMMON))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**_COMMON))  # q/k/v biases: exercised too
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**_COMMON, sliding_window=None))
    else:
        raise ValueError(family)
    return model.train()


def full_batch(seq_len: int, *, batch_size: int, seed: int, pad: int = 0) -> dict[str, torch.Tensor]:
    """input_ids, HF (unshifted) labels, attention_mask; the last ``pad`` positions of row 0 are right padding
    and one label in row 0 is ignored."""
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    labels = ids.clone()
    mask = torch.ones_like(ids)
    if pad:
        ids[0, seq_len - pad :] = 0
        mask[0, seq_len - pad :] = 0
        labels[0, seq_len - pad :] = -100
    labels[0, 3] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def hf_loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference: the unmodified model's own forward and HF loss over the full (unsharded) batch. Right padding
    needs no mask under causal attention (no real token sees a pad); its labels are -100."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
