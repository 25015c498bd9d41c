"""The map-style collate: items (token ids, or dicts with labels, packed documents, images) -> one full batch,
right-padded, for ``prepare_batch`` to shard. Used by ``SequenceParallelLoader``'s map-style path and by dynamic
sequence parallelism (one row per item)."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
import torch.nn.functional as F

from .media import MEDIA_KEYS, TOKEN_TYPES_KEY

__all__ = ["collate_right_padded"]


def collate_right_padded(
    items: Sequence[Any], *, pad_token_id: int = 0, ignore_index: int = -100, token_keys: Sequence[str] = ()
) -> dict[str, Any]:
    """Map-style items (a 1-D tensor / list of token ids, or a dict with ``input_ids`` and optional
    ``labels``) -> one batch, right-padded to the longest item with an ``attention_mask``.

    Packed items carry ``position_ids`` (restarting at 0 per document) or ``document_lengths`` (a list of ints);
    when any item does, every row gets them (an item without is one document). ``token_keys``: per-token keys kept
    and right-padded with 0 like the ids (a model's ``token_type_ids``, ``vision.type_spans.key``)."""
    rows = [it if isinstance(it, Mapping) else {"input_ids": it} for it in items]
    ids = [torch.as_tensor(r["input_ids"]).long().reshape(-1) for r in rows]
    _check_per_token_keys(rows, ids, token_keys)
    n = max(len(x) for x in ids)
    out: dict[str, Any] = {
        "input_ids": torch.stack([F.pad(x, (0, n - len(x)), value=pad_token_id) for x in ids]),
        "attention_mask": torch.stack([F.pad(torch.ones_like(x), (0, n - len(x))) for x in ids]),
    }
    if any("labels" in r for r in rows):
        labels = [torch.as_tensor(r.get("labels", x)).long().reshape(-1) for r, x in zip(rows, ids)]
        out["labels"] = torch.stack([F.pad(y, (0, n - len(y)), value=ignore_index) for y in labels])
    if any("position_ids" in r for r in rows):
        pos = [torch.as_tensor(r["position_ids"]).long().reshape(-1) if "position_ids" in r
               else torch.arange(len(x)) for r, x in zip(rows, ids)]
        out["position_ids"] = torch.stack([F.pad(q, (0, n - len(q))) for q in pos])  # padding: masked out
    for key in (*MEDIA_KEYS, TOKEN_TYPES_KEY, *token_keys):  # images / videos: the processor's rows, in item order
        if any(r.get(key) is not None for r in rows):
            parts = [torch.as_tensor(r[key]) for r in rows if r.get(key) is not None]
            if key == TOKEN_TYPES_KEY or key in token_keys:
                parts = [torch.as_tensor(r.get(key, torch.zeros_like(x))).reshape(-1) for r, x in zip(rows, ids)]
                out[key] = torch.stack([F.pad(t, (0, n - len(t))) for t in parts])
            else:
                out[key] = torch.cat([t.reshape(-1) if t.dim() == 0 else t for t in parts])
    if any("document_lengths" in r for r in rows):
        out["document_lengths"] = [
            [int(v) for v in torch.as_tensor(r["document_lengths"]).reshape(-1).tolist()] if "document_lengths" in r
            else [len(x)] for r, x in zip(rows, ids)
        ]
    return out


_COLLATED = frozenset({"input_ids", "labels", "position_ids", "document_lengths", "attention_mask", *MEDIA_KEYS, TOKEN_TYPES_KEY})


def _check_per_token_keys(rows: Sequence[Mapping[str, Any]], ids: Sequence[torch.Tensor], token_keys) -> None:
    """Refuse an item key of one value per token that the collate would drop (PaliGemma's ``token_type_ids`` under
    dynamic sequence parallelism): the model would run without it. A dataset's text columns are left behind."""
    for r, x in zip(rows, ids):
        for key, value in r.items():
            if key in _COLLATED or key in token_keys or not isinstance(value, (torch.Tensor, list, tuple)):
                continue
            if torch.as_tensor(value).numel() == len(x) > 1:
                raise ValueError(f"item key {key!r} holds one value per token, which this loader does not pass to "
                                 "the model: drop it, or use the fixed loader of a model that reads it (Gemma 3)")
