"""Attention layers whose result depends on where a token sits in the sequence beyond RoPE: chunked attention
(Llama 4's ``attention_chunk_size``) served as fixed document boundaries, and queries scaled by position (Llama 4's
temperature tuning on its NoPE layers), rescaled here from the local index the layer used to the token's real
position. Design: Note [Chunked attention and position-scaled queries] in docs/design/attention.md.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from ..attention.documents import BatchDocuments, SequenceBatch

__all__ = ["POSITIONS_KWARG", "chunk_layers_known", "chunk_size", "chunked_documents", "knows_its_positions",
           "position_scaled", "scales_by_position", "with_chunks"]

POSITIONS_KWARG = "wallfacer_positions"
"""The model-forward keyword carrying this rank's token positions ([B, S_l], inside their documents) to the
attention layers that scale queries by position."""


def chunk_size(module: nn.Module) -> int | None:
    """The chunk of a chunked-attention layer (its ``config.layer_types`` entry is "chunked_attention"), else None;
    None also when the config does not say which layers are chunked."""
    cfg = getattr(module, "config", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if not chunk or types is None or idx is None or idx >= len(types):
        return None
    return int(chunk) if types[idx] == "chunked_attention" else None


def chunk_layers_known(module: nn.Module, text: Any) -> bool:
    """Whether the config names each layer's type, so ``chunk_size`` can tell chunked layers from full ones."""
    cfg = getattr(module, "config", None) or text
    return getattr(cfg, "layer_types", None) is not None and getattr(module, "layer_idx", None) is not None


@lru_cache(maxsize=64)
def chunked_documents(documents: BatchDocuments, chunk: int) -> BatchDocuments:
    """Every document cut into chunks of ``chunk`` tokens from its own start (a document trained alone is chunked
    from its position 0; pure)."""
    if documents.has_spans:
        raise ValueError("chunked attention (attention_chunk_size) with bidirectional spans is not supported: the "
                         "model's own mask for that combination is not reproduced here; train without spans")
    rows = []
    for r, starts in enumerate(documents.starts):
        ends = (*starts[1:], documents.seq_len)
        rows.append(tuple(p for s, e in zip(starts, ends) for p in range(s, e, chunk)))
    return BatchDocuments(starts=tuple(rows), seq_len=documents.seq_len)


def with_chunks(batch: SequenceBatch | None, *, chunk: int, seq_len: int, rows: int) -> SequenceBatch:
    """``batch`` (None: one document per row) with every document cut into chunks of ``chunk`` tokens."""
    docs = batch.documents if batch is not None and batch.documents is not None else BatchDocuments.single(seq_len,
                                                                                                            rows)
    return replace(batch or SequenceBatch(), documents=chunked_documents(docs, chunk))


_TEMPERATURE_ATTRS = ("attn_temperature_tuning", "floor_scale", "attn_scale", "use_rope")


def knows_its_positions(module: nn.Module) -> bool:
    """Whether the layer's own position arithmetic (a local ``arange``) is one ``position_scaled`` corrects: Llama
    4's attention temperature tuning, whether or not it is on."""
    return all(hasattr(module, a) for a in _TEMPERATURE_ATTRS)


def scales_by_position(module: nn.Module) -> bool:
    """Whether the layer scales its queries by position (temperature tuning on, on a layer without RoPE)."""
    return knows_its_positions(module) and bool(module.attn_temperature_tuning) and not bool(module.use_rope)


def _temperature(module: nn.Module, positions: torch.Tensor) -> torch.Tensor:
    """The layer's query scale at ``positions``: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1."""
    p = positions.float()
    return torch.log1p(torch.floor((p + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def position_scaled(module: nn.Module, query: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """q [B, h, S_l, d] as the layer would have scaled it at the tokens' ``positions`` [B or 1, S_l] instead of at
    0..S_l-1 (the shard's local index it used): multiplied by scale(positions) / scale(local)."""
    if not scales_by_position(module):
        return query
    if positions is None:
        raise ValueError(f"{type(module).__name__} scales queries by position, but no positions reached it: build "
                         "the model with ds_wallfacer.integration.initialize, which passes them")
    s = query.shape[2]
    local = torch.arange(s, device=query.device)
    fix = _temperature(module, positions.to(query.device).reshape(-1, s)) / _temperature(module, local)
    return (query * fix[:, None, :, None]).to(query.dtype)
