"""A batch's documents as the attention takes them, pure (no torch): ``BatchDocuments`` (each row's document starts,
and its bidirectional spans) and ``SequenceBatch`` (the documents and the chunk assignment, handed to the attention at
every forward). How a block call splits by them (and by a sliding window) is ``blocks.py``'s.

Design: Note [Documents and windows in block calls] in docs/design/documents.md; Note [Bidirectional spans] in
docs/design/spans.md.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchDocuments", "SequenceBatch"]


@dataclass(frozen=True)
class BatchDocuments:
    """The document structure of one batch: per row, the global start index of each document (first = 0)."""

    starts: tuple[tuple[int, ...], ...]
    seq_len: int
    spans: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Per row, its bidirectional spans as global [start, end) token ranges, sorted, disjoint, each inside one
    document: a query sees every key of its span, later ones included (Note [Bidirectional spans]); None: none."""

    def __post_init__(self) -> None:
        for r, s in enumerate(self.starts):
            if not s or s[0] != 0 or any(b <= a for a, b in zip(s, s[1:])) or s[-1] >= self.seq_len:
                raise ValueError(f"row {r}: document starts {list(s)[:8]}... must begin at 0, increase and stay "
                                 f"below the sequence length {self.seq_len}")
        if self.spans is not None:
            if len(self.spans) != len(self.starts):
                raise ValueError(f"bidirectional spans are given for {len(self.spans)} rows, documents for "
                                 f"{len(self.starts)}: give one (possibly empty) list of spans per row")
            for r, row in enumerate(self.spans):
                self._check_spans(r, row)

    def _check_spans(self, r: int, row: tuple[tuple[int, int], ...]) -> None:
        import bisect

        starts, end = self.starts[r], 0
        for a, b in row:
            if not end <= a < b <= self.seq_len:
                raise ValueError(f"row {r}: bidirectional span [{a}, {b}) must be non-empty, inside [0, "
                                 f"{self.seq_len}) and after the previous span (which ends at {end}): give spans "
                                 "sorted and disjoint")
            if bisect.bisect_right(starts, a) != bisect.bisect_right(starts, b - 1):
                raise ValueError(f"row {r}: bidirectional span [{a}, {b}) crosses a document start: a span must "
                                 "lie inside one document")
            end = b

    @classmethod
    def single(cls, seq_len: int, rows: int = 1) -> "BatchDocuments":
        """One document per row (plain causal attention)."""
        return cls(starts=((0,),) * rows, seq_len=seq_len)

    @property
    def uniform(self) -> bool:
        """Every row has the same documents (then one kernel call serves all rows)."""
        return all(s == self.starts[0] for s in self.starts)

    @property
    def has_spans(self) -> bool:
        """Some row has a span of two or more tokens (one token's span is its causal row already)."""
        return self.spans is not None and any(b - a > 1 for row in self.spans for a, b in row)

    @property
    def uniform_spans(self) -> bool:
        """Every row has the same spans (then one kernel call serves all rows)."""
        return self.spans is None or all(s == self.spans[0] for s in self.spans)

    def row_spans(self, row: int | None) -> tuple[tuple[int, int], ...]:
        """The spans of ``row`` (None: every row's, when they are the same) that pair two tokens or more."""
        if self.spans is None:
            return ()
        return tuple((a, b) for a, b in self.spans[0 if row is None else row] if b - a > 1)

    def without_spans(self) -> "BatchDocuments":
        return BatchDocuments(starts=self.starts, seq_len=self.seq_len)

    def doc_lengths(self, row: int) -> list[int]:
        s = self.starts[row]
        return [b - a for a, b in zip(s, (*s[1:], self.seq_len))]


@dataclass(frozen=True)
class SequenceBatch:
    """What attention needs to know about the current batch beyond its tensors (built once per forward by the
    integration from the loader's ``document_starts`` / ``chunk_assignment``)."""

    documents: BatchDocuments | None = None
    """Packed documents (None: one document per row)."""
    assignment: tuple[tuple[int, ...], ...] | None = None
    """Chunks held by every ring rank (a balanced sharding); None: the layout's ``sharding``."""
