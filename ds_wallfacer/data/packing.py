"""Packed batches: several documents per row, read from HF-style position ids (restarting at 0 at each document) or
from document lengths, and turned into what the loader hands on: each token's position inside its document, the
labels of document ends dropped, and one ``document_ids`` row per sequence (right padding is one more document).
Bidirectional spans travel beside the documents the same way (``normalize_spans``, ``span_tensor``, ``spans_of``).

Design: Note [Packed documents] in docs/design/documents.md; Note [Bidirectional spans] in docs/design/spans.md.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = [
    "SPANS_KEY",
    "document_ids",
    "document_lengths_from_position_ids",
    "document_positions",
    "document_starts",
    "starts_of",
    "mask_document_ends",
    "normalize_document_lengths",
    "normalize_spans",
    "span_tensor",
    "spans_of",
    "type_runs",
]

SPANS_KEY = "bidirectional_spans"
"""The batch key of the rows' bidirectional spans, in the loader's input and in its output."""

_COLLATOR_HINT = (
    "packed position ids restart at 0 at each document start and increase by 1 inside a document "
    "(0,1,2,0,1,0,...: transformers' DataCollatorWithFlattening)"
)


def document_lengths_from_position_ids(position_ids: torch.Tensor, *, real_lengths: Sequence[int]) -> list[list[int]]:
    """Per row, the lengths of its documents read from packed ``position_ids`` [B, N]: a document starts at every
    0. Only the first ``real_lengths[b]`` tokens of row b are read (the rest is right padding). Raises when a row
    does not start at 0 or a position inside a document is not the previous one plus 1."""
    pos = position_ids.long()
    out = []
    for b, n in enumerate(real_lengths):
        row = pos[b, :n]
        if n == 0:
            out.append([])
            continue
        if int(row[0]) != 0:
            raise ValueError(f"position_ids of row {b} start at {int(row[0])}, not 0: {_COLLATOR_HINT}")
        starts = row == 0
        bad = (~starts[1:]) & (row[1:] != row[:-1] + 1)
        if bool(bad.any()):
            t = int(bad.nonzero()[0]) + 1
            raise ValueError(
                f"position_ids of row {b} go from {int(row[t - 1])} to {int(row[t])} at token {t}: {_COLLATOR_HINT}"
            )
        begin = starts.nonzero().flatten().tolist() + [n]
        out.append([hi - lo for lo, hi in zip(begin, begin[1:])])
    return out


def normalize_document_lengths(lengths: Any, *, real_lengths: Sequence[int]) -> list[list[int]]:
    """``document_lengths`` as given (per row a list of ints, or a [B, max_docs] tensor padded with 0s; a flat
    list or 1-D tensor for a single row) -> per row a list of positive ints, checked to sum to the row's
    ``real_lengths`` (its length before right padding). Zero lengths are dropped."""
    rows_n = len(real_lengths)
    if isinstance(lengths, torch.Tensor):
        t = lengths if lengths.dim() != 1 else lengths.unsqueeze(0)
        if t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(
                f"document_lengths as a tensor must be integer [batch, max_docs] padded with 0s; got {t.dtype} "
                f"shape {tuple(lengths.shape)}"
            )
        rows = t.tolist()
    else:
        rows = list(lengths)
        if rows and all(isinstance(x, int) and not isinstance(x, bool) for x in rows):
            rows = [rows]  # one row
    if len(rows) != rows_n:
        raise ValueError(f"document_lengths has {len(rows)} rows but input_ids has {rows_n}: give one list per row")
    out = []
    for b, (row, n) in enumerate(zip(rows, real_lengths)):
        row = list(row)
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in row):
            raise ValueError(f"document_lengths of row {b} = {row} must be non-negative integers")
        total = sum(row)
        if total != n:
            raise ValueError(
                f"document_lengths of row {b} sum to {total}, but the row has {n} tokens (before right padding): "
                "the lengths of a row's documents must add up to its length exactly"
            )
        out.append([x for x in row if x])
    return out


def document_ids(doc_lengths_per_row: Sequence[Sequence[int]], *, seq_len: int) -> torch.Tensor:
    """[B, seq_len] int32: document index of each token (0, 1, 2, ... along each row); the tokens after a row's
    documents (right padding) get one further id of their own."""
    rows = []
    for lengths in doc_lengths_per_row:
        pad = seq_len - sum(lengths)
        if pad < 0:
            raise ValueError(f"documents of {sum(lengths)} tokens do not fit a row of {seq_len}")
        counts = torch.tensor([*lengths, pad], dtype=torch.long)
        rows.append(torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32), counts))
    return torch.stack(rows) if rows else torch.zeros(0, seq_len, dtype=torch.int32)


def document_starts(doc_lengths_per_row: Sequence[Sequence[int]], *, seq_len: int) -> torch.Tensor:
    """[B, D] int64: per row the global start of each document (right padding, if any, is one more document), the
    rows' tails filled with ``seq_len``: the batch's whole document structure, a few numbers per document."""
    rows = []
    for lengths in doc_lengths_per_row:
        pad = seq_len - sum(lengths)
        if pad < 0:
            raise ValueError(f"documents of {sum(lengths)} tokens do not fit a row of {seq_len}")
        starts, at = [], 0
        for x in [*lengths, pad]:
            if x:
                starts.append(at)
                at += x
        rows.append(starts)
    width = max((len(r) for r in rows), default=1)
    return torch.tensor([r + [seq_len] * (width - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), width)


def starts_of(document_starts: torch.Tensor, seq_len: int) -> tuple[tuple[int, ...], ...]:
    """Inverse of ``document_starts``: per row the starts below ``seq_len`` (a host copy of [B, D] numbers)."""
    return tuple(tuple(x for x in row if x < seq_len) for row in document_starts.tolist())


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """[B, N] long: each token's position inside its document (what the document would see processed alone)."""
    n = doc_ids.shape[1]
    idx = torch.arange(n).expand_as(doc_ids)
    new = torch.ones_like(doc_ids, dtype=torch.bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start = torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - start


def mask_document_ends(shift_labels: torch.Tensor, doc_ids: torch.Tensor, *, ignore_index: int) -> torch.Tensor:
    """``shift_labels`` with the label of every document's last token set to ``ignore_index`` (it would
    predict the next document's first token)."""
    end = torch.ones_like(doc_ids, dtype=torch.bool)
    end[:, :-1] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return shift_labels.masked_fill(end, ignore_index)


def normalize_spans(value: Any, *, real_lengths: Sequence[int]) -> list[list[tuple[int, int]]]:
    """A batch's ``bidirectional_spans``: per row a list of (start, end) pairs, or a [B, S, 2] tensor, in the row's
    token indices; a pair with start == end is padding. Checked: sorted, disjoint, within the row's real tokens
    (whether each lies inside one document is ``attention.documents.BatchDocuments``'s check)."""
    rows = value.tolist() if isinstance(value, torch.Tensor) else list(value)
    if len(rows) != len(real_lengths):
        raise ValueError(f"{SPANS_KEY} has {len(rows)} rows, the batch {len(real_lengths)}: give one list of "
                         "(start, end) pairs per row")
    out = []
    for r, (row, n) in enumerate(zip(rows, real_lengths)):
        spans, end = [], 0
        for pair in row:
            if len(pair) != 2:
                raise ValueError(f"row {r}: {SPANS_KEY} entry {pair} is not a (start, end) pair")
            a, b = int(pair[0]), int(pair[1])
            if a == b:
                continue
            if not end <= a < b <= n:
                raise ValueError(f"row {r}: bidirectional span [{a}, {b}) must lie in the row's {n} tokens, after "
                                 f"the previous span (which ends at {end}): give spans sorted and disjoint")
            spans.append((a, b))
            end = b
        out.append(spans)
    return out


def span_tensor(spans_per_row: Sequence[Sequence[tuple[int, int]]], *, seq_len: int) -> torch.Tensor:
    """[B, S, 2] int64: per row its spans, the rows' tails filled with the empty span (seq_len, seq_len)."""
    width = max((len(r) for r in spans_per_row), default=0) or 1
    rows = [[list(p) for p in r] + [[seq_len, seq_len]] * (width - len(r)) for r in spans_per_row]
    return torch.tensor(rows, dtype=torch.int64).reshape(len(rows), width, 2)


def spans_of(spans: torch.Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Inverse of ``span_tensor``: per row its non-empty spans (a host copy of [B, S, 2] numbers)."""
    return tuple(tuple((a, b) for a, b in row if a < b) for row in spans.tolist())


def type_runs(token_types: torch.Tensor, value: int, *, starts: Sequence[Sequence[int]] | None = None,
              single: bool = False) -> list[list[tuple[int, int]]]:
    """Per row of ``token_types`` [B, N], the maximal runs of tokens of type ``value`` as (start, end) spans, cut at
    the row's document ``starts`` (a span lies inside one document): what ``bidirectional_spans`` takes for Gemma 3's
    images (``token_type_ids == 1``; transformers' ``get_block_sequence_ids_for_mask`` starts a block at each image
    token after a non-image one) and PaliGemma's prefix (``== 0``). ``single``: transformers makes all of a row's
    tokens of that type one block (PaliGemma), so more than one run in a document is refused."""
    out = []
    for r, row in enumerate((token_types == value).tolist()):
        cuts = set(starts[r]) if starts is not None else {0}
        spans: list[tuple[int, int]] = []
        for t, on in enumerate(row):
            if on and spans and spans[-1][1] == t and t not in cuts:
                spans[-1] = (spans[-1][0], t + 1)
            elif on:
                spans.append((t, t + 1))
        if single:
            doc = lambda t: sum(1 for s in cuts if s <= t)  # noqa: E731
            docs = [doc(a) for a, _ in spans]
            if len(set(docs)) != len(docs):
                raise ValueError(f"row {r}: the tokens of type {value} form {len(spans)} runs, some in one document; "
                                 "the model attends across them as one block, which bidirectional spans cannot "
                                 "express: give each document one contiguous run")
        out.append(spans)
    return out
