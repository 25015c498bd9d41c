"""Which query/key pairs of a block call are computed when a batch packs several documents per sequence, or a
layer has a sliding window: pure integer math (no torch). ``SequenceBatch`` carries a batch's documents and chunk
assignment to the attention; ``segments`` splits a block call into one ordinary kernel call per document present on
both sides, and ``window_tiles`` tiles a windowed segment.

Design: Note [Documents and windows in block calls] and Note [Sliding windows in block calls] in
docs/design/documents.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

__all__ = [
    "BatchDocuments", "Segment", "SequenceBatch", "Tile", "buffer_runs", "global_ranges", "segments", "window_tiles",
]


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


@dataclass(frozen=True)
class Segment:
    """One kernel call: buffer ranges [q_lo, q_hi) x [k_lo, k_hi) of batch ``row`` (None: every row)."""

    row: int | None
    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool
    windowed: bool
    """Some pair lies outside the sliding window: the caller applies a window mask (global indices)."""


def buffer_runs(chunks: Sequence[int], chunk_len: int) -> list[tuple[int, int, int]]:
    """Sorted chunks -> maximal runs (buffer offset, global start, length) of consecutive chunks."""
    runs: list[tuple[int, int, int]] = []
    for i, c in enumerate(chunks):
        if runs and runs[-1][1] + runs[-1][2] == c * chunk_len:
            o, g, n = runs[-1]
            runs[-1] = (o, g, n + chunk_len)
        else:
            runs.append((i * chunk_len, c * chunk_len, chunk_len))
    return runs


def _doc_pieces(runs: list[tuple[int, int, int]], starts: Sequence[int], seq_len: int):
    """Per document present in the buffer: (doc, buffer lo, buffer hi, first global index, last global index)."""
    import bisect

    out: list[list[int]] = []
    for off, g0, n in runs:
        g, end = g0, g0 + n
        while g < end:
            d = bisect.bisect_right(starts, g) - 1
            d_end = starts[d + 1] if d + 1 < len(starts) else seq_len
            stop = min(end, d_end)
            lo, hi = off + (g - g0), off + (stop - g0)
            if out and out[-1][0] == d and out[-1][2] == lo:
                out[-1][2], out[-1][4] = hi, stop - 1
            else:
                out.append([d, lo, hi, g, stop - 1])
            g = stop
    return out


def segments(
    q_chunks: Sequence[int], k_chunks: Sequence[int], *, chunk_len: int, causal: bool, docs: BatchDocuments,
    window: int | None = None,
) -> list[Segment]:
    """The kernel calls of one block call (sorted ``q_chunks`` x sorted ``k_chunks``, ``causal`` as in the call)."""
    rows: list[int | None] = [None] if docs.uniform else list(range(len(docs.starts)))
    q_runs, k_runs = buffer_runs(q_chunks, chunk_len), buffer_runs(k_chunks, chunk_len)
    out: list[Segment] = []
    for row in rows:
        starts = docs.starts[0 if row is None else row]
        kp = {p[0]: p for p in _doc_pieces(k_runs, starts, docs.seq_len)}
        for d, qa, qb, gq_first, gq_last in _doc_pieces(q_runs, starts, docs.seq_len):
            if d not in kp:
                continue
            _, ka, kb, gk_first, gk_last = kp[d]
            windowed = False
            if window is not None:
                if causal:  # same buffer range on both sides; the diagonal pair is always visible
                    windowed = gq_last - gk_first >= window
                else:  # every key before every query
                    if gq_first - gk_last >= window:
                        continue
                    windowed = gq_last - gk_first >= window
            out.append(Segment(row, qa, qb, ka, kb, causal, windowed))
    return out


def _to_global(runs: list[tuple[int, int, int]], i: int) -> int:
    """Global token index of buffer position ``i``."""
    for off, g0, n in runs:
        if off <= i < off + n:
            return g0 + (i - off)
    raise IndexError(f"buffer position {i} outside the runs {runs}")


def _first_at_least(runs: list[tuple[int, int, int]], g: int, lo: int, hi: int) -> int:
    """The first buffer position in [lo, hi) whose global index is >= g (hi if none); globals ascend."""
    for off, g0, n in runs:
        a, b = max(off, lo), min(off + n, hi)
        if a >= b:
            continue
        if g0 + (b - 1 - off) >= g:
            return max(a, off + (g - g0)) if g > g0 + (a - off) else a
    return hi


def global_ranges(runs: list[tuple[int, int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Buffer [lo, hi) -> its global index ranges [(start, stop), ...] in buffer order."""
    out = []
    for off, g0, n in runs:
        a, b = max(off, lo), min(off + n, hi)
        if a < b:
            out.append((g0 + a - off, g0 + b - off))
    return out


@dataclass(frozen=True)
class Tile:
    """Part of a windowed segment: queries [q_lo, q_hi) against the keys [k_lo, k_hi) that may be in their
    window; ``masked``: the caller builds the window (and causal) mask from global indices."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    masked: bool
    causal: bool = False
    """The tile's keys are its queries (the diagonal of a causal segment): an ordinary causal call, no mask."""


def _query_tiles(seg: Segment, q_runs: list[tuple[int, int, int]], tile: int):
    """[lo, hi) query tiles of at most ``tile`` rows covering the segment, none spanning two runs of chunks (so a
    tile's queries are consecutive tokens, and every key in its reach is seen by one of them)."""
    for off, _, n in q_runs:
        a, b = max(off, seg.q_lo), min(off + n, seg.q_hi)
        for ta in range(a, b, tile):
            yield ta, min(ta + tile, b)


def window_tiles(
    seg: Segment, q_runs: list[tuple[int, int, int]], k_runs: list[tuple[int, int, int]], *, window: int,
    tile: int = 2048,
) -> list[Tile]:
    """Split a windowed segment into query tiles, each against only the keys its window can reach, so a mask is
    never larger than tile x (tile + window); a tile no taller than the window is cut by keys into the part only
    some of its queries reach (masked), the part all of them see (no mask) and its own diagonal (causal, no mask),
    so its mask is at most tile x tile (Note [Sliding windows in block calls])."""
    if 256 <= window < tile:
        tile = window
    out = []
    for ta, tb in _query_tiles(seg, q_runs, tile):
        g_first, g_last = _to_global(q_runs, ta), _to_global(q_runs, tb - 1)
        at = lambda g: _first_at_least(k_runs, g, seg.k_lo, seg.k_hi)  # noqa: E731
        ka, kb = at(g_first - window + 1), at(g_last + 1)
        if ka >= kb:
            continue
        far = g_last - _to_global(k_runs, ka) >= window
        late = seg.causal and _to_global(k_runs, kb - 1) > g_first  # some key after some query
        if tb - ta > window or not (far or late):
            out.append(Tile(ta, tb, ka, kb, masked=far or late))
            continue
        seen, own = at(g_last - window + 1), at(g_first)  # keys from ``seen`` on reach every query; from ``own``, late
        if ka < seen:
            out.append(Tile(ta, tb, ka, seen, masked=True))
        if seen < own:
            out.append(Tile(ta, tb, seen, own, masked=False))
        if own < kb:
            diagonal = seg.causal and (own, kb) == (ta, tb)
            out.append(Tile(ta, tb, own, kb, masked=not diagonal, causal=diagonal))
    return out
