"""Tiny HF causal LMs built from config (no downloads) for the MsT tests."""
from __future__ import annotations

import torch

from tests.models import tiny_model as _tiny_model

VOCAB = 160
_SIZES = dict(intermediate_size=176, vocab_size=VOCAB, attn_implementation="eager")


def tiny_model(kind: str, *, seed: int = 0, tie: bool = False) -> torch.nn.Module:
    """The shared tiny model (``tests/models.py``) at the MsT tests' sizes: vocabulary 160, MLP width 176."""
    return _tiny_model(kind, seed=seed, tie=tie, **_SIZES)


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
