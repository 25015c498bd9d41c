"""Tiny HF causal LMs built from config (no downloads) and the non-parallel reference run."""
from __future__ import annotations

import torch

from tests.models import tiny_model as _tiny_model

VOCAB = 256
FAMILIES = ("llama", "qwen2", "mistral")


def tiny_model(family: str, *, seed: int = 0) -> torch.nn.Module:
    """The shared tiny model (``tests/models.py``): 4 q / 2 kv heads, SDPA attention, vocabulary 256."""
    return _tiny_model(family, seed=seed)


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
