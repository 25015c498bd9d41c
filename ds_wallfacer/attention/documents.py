"""A batch's documents as the attention takes them, pure (no torch): ``BatchDocuments`` (each row's document starts)
and ``SequenceBatch`` (the documents and the chunk assignment, handed to the attention at every forward). How a
block call splits by them (and by a sliding window) is ``blocks.py``'s.

Design: Note [Documents and windows in block calls] in docs/design/documents.md.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BatchDocuments", "SequenceBatch"]


@dataclass(frozen=True)
class BatchDocuments:
    """The document structure of one batch: per row, the global start index of each document (first = 0)."""

    starts: tuple[tuple[int, ...], ...]
    seq_len: int

    def __post_init__(self) -> None:
        for r, s in enumerate(self.starts):
            if not s or s[0] != 0 or any(b <= a for a, b in zip(s, s[1:])) or s[-1] >= self.seq_len:
                raise ValueError(f"row {r}: document starts {list(s)[:8]}... must begin at 0, increase and stay "
                                 f"below the sequence length {self.seq_len}")

    @classmethod
    def single(cls, seq_len: int, rows: int = 1) -> "BatchDocuments":
        """One document per row (plain causal attention)."""
        return cls(starts=((0,),) * rows, seq_len=seq_len)

    @property
    def uniform(self) -> bool:
        """Every row has the same documents (then one kernel call serves all rows)."""
        return all(s == self.starts[0] for s in self.starts)

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
