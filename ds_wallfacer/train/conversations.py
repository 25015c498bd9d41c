"""Conversations with images for the trainer: a ``.jsonl`` of TRL-style rows (``{"messages": [...], "images":
["a.png", ...]}``, image paths relative to the file) rendered by the model folder's processor.

Each conversation is one training row: the processor's chat template with the images (placed before the first user
message's text when the messages are plain strings, as TRL places them; or where ``{"type": "image"}`` blocks
stand), its image tokens expanded and its ``pixel_values`` (and whatever else the processor gives for them)
computed, then right-padded to ``--seq_len``. The loss covers the assistant turns when the chat template marks them
with ``{% generation %}``, else every token. Rows are never cut (a cut would split an image from its tokens): a
conversation longer than ``--seq_len`` is refused. The rows are built again at every start (the images are small
next to the time a step takes; nothing is cached). The loader (``data/loader.py``) shards each batch like text
and hands the images to every rank of the group, whose adapter splits the vision tower's work.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..data.media import MEDIA_KEYS, TOKEN_TYPES_KEY
from .cli import StartupError

__all__ = ["ConversationData", "ConversationRows", "eval_rounds", "is_conversation_file", "load_conversations",
           "load_processor"]

_PER_TOKEN = (TOKEN_TYPES_KEY,)
"""Processor outputs laid out like the tokens (padded with 0 beside them); every other media key is concatenated
over the batch's conversations in order."""


def is_conversation_file(path: str | Path) -> bool:
    """A ``.jsonl`` file whose first row has a ``"messages"`` list."""
    p = Path(path)
    if not (p.is_file() and p.suffix == ".jsonl"):
        return False
    with open(p, encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first)
    except ValueError:
        return False
    return isinstance(row, dict) and isinstance(row.get("messages"), list)


@dataclass
class ConversationRows:
    """Rows of one conversation each: ``ids`` [n, seq_len] (right-padded), ``labels`` [n, seq_len] (-100 = no
    target), ``lengths`` (real tokens), ``media`` (each row's images as the processor gave them). Indexed like the
    text path's token array (``train_batches``): ``rows[indices]`` is one full batch."""

    ids: np.ndarray
    labels: np.ndarray
    lengths: list[int]
    media: list[dict[str, torch.Tensor]] = field(repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def size(self) -> int:
        return int(self.ids.size)

    def __getitem__(self, index: Any) -> dict[str, Any]:
        """The rows ``index`` (an array of row numbers) as one batch: ``input_ids``, ``labels``,
        ``attention_mask`` [m, seq_len] and the media keys (per-token ones padded, the others concatenated)."""
        rows = np.atleast_1d(np.asarray(index))
        ids = torch.from_numpy(self.ids[rows].astype(np.int64))
        mask = torch.zeros_like(ids)
        for k, r in enumerate(rows):
            mask[k, : self.lengths[r]] = 1
        batch: dict[str, Any] = {"input_ids": ids, "labels": torch.from_numpy(self.labels[rows].astype(np.int64)),
                                 "attention_mask": mask}
        for key in sorted({k for r in rows for k in self.media[r]}):
            parts = [self.media[r][key] for r in rows if key in self.media[r]]
            if key in _PER_TOKEN:
                batch[key] = torch.stack([torch.nn.functional.pad(p, (0, ids.shape[1] - p.shape[-1])) for p in parts])
            else:
                batch[key] = torch.cat(parts)
        return batch

    def targets(self, rows: Sequence[int]) -> int:
        """Tokens with a target in ``rows`` (a label after the first token)."""
        return int(sum((self.labels[r, 1:] != -100).sum() for r in rows))


@dataclass
class ConversationData:
    """The training and held-out conversations (the trainer's ``data``, as ``data.TokenData`` for text)."""

    train: ConversationRows
    eval: ConversationRows
    tokens: int
    """Real tokens over all conversations."""
    processor: Any = None
    """What rendered them: exported beside the trained model (instead of the tokenizer alone)."""
    cache_file: None = None
    cache_hit: bool = False


def _structured(messages: list[dict[str, Any]], images: list[Any]) -> list[dict[str, Any]]:
    """``messages`` with every content a list of blocks and the images in their image blocks: plain-string
    messages get the images before the first user message's text (TRL's placement)."""
    out, placed = [], False
    for m in messages:
        content = m.get("content")
        if isinstance(content, str):
            blocks = [{"type": "text", "text": content}]
            if m.get("role") == "user" and not placed:
                blocks = [{"type": "image"} for _ in images] + blocks
                placed = True
            content = blocks
        out.append({**m, "content": content})
    slots = [b for m in out for b in m["content"] if isinstance(b, dict) and b.get("type") == "image"]
    if len(slots) != len(images):
        raise ValueError(f"{len(images)} images but {len(slots)} image blocks in the messages")
    for block, image in zip(slots, images):
        block["image"] = image
    return out


def _render(processor: Any, row: dict[str, Any], root: Path, *, assistant_only: bool) -> dict[str, torch.Tensor]:
    """One conversation through the processor's chat template: ``input_ids`` [L], ``labels`` [L] and the media."""
    from PIL import Image

    images = [Image.open(root / p).convert("RGB") for p in row.get("images") or []]
    out = processor.apply_chat_template(
        [_structured(row["messages"], images)], tokenize=True, return_dict=True, return_tensors="pt",
        return_assistant_tokens_mask=assistant_only, processor_kwargs={"add_special_tokens": False},
    )
    ids = out["input_ids"][0]
    labels = ids.clone()
    if assistant_only:
        labels[out["assistant_masks"][0] == 0] = -100
    known = {"input_ids", "attention_mask", "assistant_masks", *MEDIA_KEYS, *_PER_TOKEN}
    unknown = sorted(set(out) - known)
    if unknown:
        raise ValueError(f"the processor gives {unknown}, which the trainer does not pass to the model")
    media = {k: (v[0] if k in _PER_TOKEN else v) for k, v in out.items() if k in MEDIA_KEYS or k in _PER_TOKEN}
    return {"input_ids": ids, "labels": labels, **media}


def _rows(rendered: list[dict[str, torch.Tensor]], *, seq_len: int, pad_id: int) -> ConversationRows:
    ids = np.full((len(rendered), seq_len), pad_id, dtype=np.int64)
    labels = np.full((len(rendered), seq_len), -100, dtype=np.int64)
    for k, r in enumerate(rendered):
        ids[k, : len(r["input_ids"])] = r["input_ids"].numpy()
        labels[k, : len(r["labels"])] = r["labels"].numpy()
    media = [{key: v for key, v in r.items() if key not in ("input_ids", "labels")} for r in rendered]
    return ConversationRows(ids, labels, [len(r["input_ids"]) for r in rendered], media)


def load_conversations(path: str | Path, processor: Any, *, seq_len: int, eval_fraction: float) -> ConversationData:
    """Every conversation of ``path`` rendered by ``processor`` and right-padded to ``seq_len``; the last
    ``eval_fraction`` held out. ``StartupError`` for a row that cannot train (named by its line)."""
    path = Path(path)
    template = getattr(processor, "chat_template", None) or ""
    assistant_only = "{% generation %}" in template.replace("{%- generation", "{% generation")
    rendered = []
    for k, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = _render(processor, json.loads(line), path.parent, assistant_only=assistant_only)
        except (ValueError, KeyError, OSError) as e:
            raise StartupError(f"--data {str(path)!r} line {k}: {e}") from None
        if len(r["input_ids"]) > seq_len:
            raise StartupError(f"--data {str(path)!r} line {k}: the conversation is {len(r['input_ids'])} tokens, "
                               f"more than --seq_len {seq_len} (a row is never cut: it would split images from their "
                               "tokens): raise --seq_len or shorten the conversation")
        rendered.append(r)
    n = len(rendered)
    n_eval = 0 if eval_fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
    pad = processor.tokenizer.pad_token_id
    pad_id = int(pad) if pad is not None else 0
    return ConversationData(train=_rows(rendered[: n - n_eval], seq_len=seq_len, pad_id=pad_id),
                            eval=_rows(rendered[n - n_eval :], seq_len=seq_len, pad_id=pad_id),
                            tokens=sum(len(r["input_ids"]) for r in rendered), processor=processor)


def eval_rounds(rows: ConversationRows, *, micro: int, dp: int) -> tuple[list[dict[str, Any]], list[int]]:
    """``data.eval_batches`` for conversations: every held-out conversation once, in rounds of one micro-batch per
    replica, missing rows filled with the last conversation with every label ignored; each batch's targets."""
    rounds = -(-len(rows) // (micro * dp))
    batches, counts = [], []
    for j in range(rounds * dp):
        idx = list(range(j * micro, (j + 1) * micro))
        batch = rows[[min(i, len(rows) - 1) for i in idx]]
        real = [i < len(rows) for i in idx]
        batch["labels"][torch.tensor([not r for r in real])] = -100
        batches.append(batch)
        counts.append(rows.targets([i for i in idx if i < len(rows)]))
    return batches, counts


def load_processor(folder: Path | None, *, model: str) -> Any:
    """The processor saved in the model's folder (``AutoProcessor``), for conversations with images."""
    if folder is None:
        raise StartupError(f"--data holds conversations, which need the model folder's processor: --model {model!r} "
                           "is a preset; give a model folder with its processor (e.g. python -m "
                           "ds_wallfacer.examples.vlm_chat --model DIR)")
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(folder))
    except (OSError, ValueError, ImportError) as e:
        raise StartupError(f"--data holds conversations, which need a processor in the model folder {str(folder)!r}: "
                           f"{e}") from None
