"""The kernel calls of one block pair, as pure integer math (no torch): the block calls of sorted query chunks
against sorted key chunks (``block_calls``: full, causal-diagonal or skipped), and their kernel calls
(``kernel_calls``): one per block call, or, with packed documents (``documents.BatchDocuments``) or a sliding window,
the block call split into one segment per document present on both sides (``segments``) and a windowed segment
into tiles (``window_tiles``), run as one varlen call for a block's diagonal segments and one for its off-diagonal
ones (``KernelCall.spans``), plus the window tiles; bidirectional spans add the pairs above the diagonal that lie in
one span (``spans.py``). The one place that splits calls by documents, spans and windows: the ring schedule
(``schedule.py``), the direct fetch (``fetch.py``) and Ulysses' local attention (``local.py``) ask it.

Design: Note [Documents and windows in block calls] and Note [Sliding windows in block calls] in
docs/design/documents.md; Note [Bidirectional spans] in docs/design/spans.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .documents import BatchDocuments
from .spans import full_layers, span_pieces, upper_runs

__all__ = ["BlockCall", "KernelCall", "Segment", "Tile", "block_calls", "buffer_runs", "call_work", "global_ranges",
           "kernel_calls", "segments", "window_tiles"]


@dataclass(frozen=True)
class BlockCall:
    """One block-kernel call: sorted query chunks [q_lo, q_hi) against sorted key chunks [k_lo, k_hi)."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool
    """Causal inside the call: only when the query and key chunks are the same run."""


def block_calls(q_chunks: Sequence[int], k_chunks: Sequence[int], *, causal: bool) -> list[BlockCall]:
    """The kernel calls for sorted query chunks against sorted key chunks.

    Non-causal: one full call. Causal: identical chunk lists give one causal call (positions ascend, so the
    mask of the concatenation is exactly the global causal mask); disjoint lists give full calls, one per run
    of queries that see the same prefix of keys (chunks below them); pairs with no visible key are skipped.
    """
    nq, nk = len(q_chunks), len(k_chunks)
    if not causal:
        return [BlockCall(0, nq, 0, nk, False)]
    if list(q_chunks) == list(k_chunks):
        return [BlockCall(0, nq, 0, nk, True)]
    if set(q_chunks) & set(k_chunks):
        raise ValueError(f"query chunks {q_chunks} and key chunks {k_chunks} partly overlap")
    calls: list[BlockCall] = []
    for qi, c in enumerate(q_chunks):
        seen = sum(1 for k in k_chunks if k < c)  # sorted keys: the visible ones are a prefix
        if seen == 0:
            continue
        if calls and calls[-1].k_hi == seen and calls[-1].q_hi == qi:
            last = calls[-1]
            calls[-1] = BlockCall(last.q_lo, qi + 1, 0, seen, False)
        else:
            calls.append(BlockCall(qi, qi + 1, 0, seen, False))
    return calls


def call_work(call: BlockCall, chunk_len: int) -> int:
    """Attention score entries a call computes (query-key pairs), for balance reports."""
    sq, sk = (call.q_hi - call.q_lo) * chunk_len, (call.k_hi - call.k_lo) * chunk_len
    return sq * (sq + 1) // 2 if call.causal else sq * sk


@dataclass(frozen=True)
class KernelCall:
    """One kernel call of a ring step: batch rows, query and key buffer slices, and a window mask's global
    index ranges (None: no mask)."""

    rows: slice
    qs: slice
    ks: slice
    causal: bool
    mask: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] | None
    work: int
    qm: int = 0
    """The team member whose query rows the call reads (``qs`` are positions in that member's shard)."""
    km: int = 0
    """The member of the held k/v block whose keys the call reads (``ks`` are positions in its shard)."""
    spans: tuple[tuple[int, int, int, int], ...] | None = None
    """A varlen call (``kernels/varlen.py``): attention of each span's queries [q_lo, q_hi) (relative to ``qs.start``)
    to its keys [k_lo, k_hi) (relative to ``ks.start``), independently; causal spans (``causal``) are diagonal
    (the same range on both sides). Query ranges are disjoint; rows of ``qs`` in no span get nothing (out 0, lse
    -inf). None: one ordinary call."""
    reverse: bool = False
    """A varlen call of causal spans whose queries and keys are both taken in descending order, keys one position
    after the queries: query i then sees exactly the keys j > i of its span, the strictly upper triangle that a
    bidirectional span adds on the diagonal (Note [Bidirectional spans])."""


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


def kernel_calls(
    q_chunks, k_chunks, calls: list[BlockCall], *, chunk_len: int, rows: int, docs: BatchDocuments | None,
    window: int | None, qm: int = 0, km: int = 0, causal: bool = True,
) -> list[KernelCall]:
    """The kernel calls of one ring step: one per block call, or, with packed documents or a sliding window, the
    document segments (``documents.py``) as varlen calls: consecutive causal segments of a row as one, every
    unmasked off-diagonal segment of a row as one (``_varlen_call``), and each window tile as its own; with
    bidirectional spans (``causal`` attention only), also the pairs they add above the diagonal (``_span_calls``);
    ``qm`` / ``km``: the members they read (``KernelCall``)."""
    L, out = chunk_len, []
    if docs is None and window is None:
        for call in calls:
            out.append(KernelCall(slice(0, rows), slice(call.q_lo * L, call.q_hi * L),
                                  slice(call.k_lo * L, call.k_hi * L), call.causal, None, rows * call_work(call, L),
                                  qm, km))
        return out
    docs = docs or BatchDocuments.single(seq_len=10**18, rows=rows)
    full: dict = {}  # per row (None: all): the unmasked full segments of every block call, buffer offsets absolute
    for call in calls:
        _segment_calls(q_chunks, k_chunks, call, chunk_len=L, rows=rows, docs=docs, window=window, qm=qm, km=km,
                       out=out, full=full)
    if causal and docs.has_spans:
        _span_calls(q_chunks, k_chunks, calls, chunk_len=L, rows=rows, docs=docs, qm=qm, km=km, out=out, full=full)
    for row, spans in full.items():
        out.extend(_varlen_call(layer, row, rows, False, qm, km) for layer in full_layers(spans))
    return out


def _segment_calls(q_chunks, k_chunks, call: BlockCall, *, chunk_len: int, rows: int, docs: BatchDocuments,
                   window: int | None, qm: int, km: int, out: list, full: dict) -> None:
    """One block call's document segments: its causal ones as varlen calls (appended to ``out``), its window tiles
    (likewise), its unmasked full ones into ``full`` (per row, buffer offsets absolute; ``kernel_calls`` runs them)."""
    L = chunk_len
    qc, kc = q_chunks[call.q_lo:call.q_hi], k_chunks[call.k_lo:call.k_hi]
    q_runs, k_runs = buffer_runs(qc, L), buffer_runs(kc, L)
    q0, k0 = call.q_lo * L, call.k_lo * L  # buffer offsets of the call inside the team / step buffer
    diagonal: list = []  # consecutive causal segments of one row, end to end: one varlen call

    def flush() -> None:
        if diagonal:
            out.append(_varlen_call([(x.q_lo + q0, x.q_hi + q0, x.k_lo + k0, x.k_hi + k0) for x in diagonal],
                                    diagonal[0].row, rows, True, qm, km))
            diagonal.clear()

    for seg in segments(qc, kc, chunk_len=L, causal=call.causal, docs=docs, window=window):
        r = slice(0, rows) if seg.row is None else slice(seg.row, seg.row + 1)
        n_rows = rows if seg.row is None else 1
        if seg.causal and not seg.windowed:
            if diagonal and (diagonal[-1].row != seg.row or diagonal[-1].q_hi != seg.q_lo):
                flush()
            diagonal.append(seg)
            continue
        flush()
        if not seg.windowed:
            full.setdefault(seg.row, []).append((q0 + seg.q_lo, q0 + seg.q_hi, k0 + seg.k_lo, k0 + seg.k_hi))
            continue
        for t in window_tiles(seg, q_runs, k_runs, window=window):
            gq, gk = global_ranges(q_runs, t.q_lo, t.q_hi), global_ranges(k_runs, t.k_lo, t.k_hi)
            mask = (tuple(gq), tuple(gk)) if t.masked else None
            sq, sk = t.q_hi - t.q_lo, t.k_hi - t.k_lo
            work = n_rows * (_masked_work(gq, gk, window) if t.masked else
                             sq * (sq + 1) // 2 if t.causal else sq * sk)
            out.append(KernelCall(r, slice(q0 + t.q_lo, q0 + t.q_hi), slice(k0 + t.k_lo, k0 + t.k_hi),
                                  t.causal, mask, work, qm, km))
    flush()


def _span_calls(q_chunks, k_chunks, calls: list[BlockCall], *, chunk_len: int, rows: int, docs: BatchDocuments,
                qm: int, km: int, out: list, full: dict) -> None:
    """What bidirectional spans add to causal attention: the pairs of one span with the key after the query
    (Note [Bidirectional spans]). On a causal-diagonal block call, each span's piece [a, b) of the buffer adds its
    strictly upper triangle: queries [a, b - 1) against keys [a + 1, b), taken in descending order so that the
    causal kernel keeps exactly j > i (one ``reverse`` varlen call per row for all pieces). Between disjoint chunk
    lists, every key chunk after a run of query chunks (``upper_runs``) adds the span's keys there to the span's
    queries, unmasked: full spans into ``full``, where they join the row's others (``full_layers``). Nothing is
    windowed: a window limits only the keys before a query (docs/design/spans.md)."""
    L = chunk_len
    per_row = not (docs.uniform and docs.uniform_spans)
    uppers = [] if list(q_chunks) == list(k_chunks) else upper_runs(q_chunks, k_chunks)
    for row in range(len(docs.spans)) if per_row else [None]:
        spans = docs.row_spans(row)
        if not spans:
            continue
        triangles = []
        for call in calls:
            if call.causal:
                q0, k0 = call.q_lo * L, call.k_lo * L
                for _, a, b in span_pieces(buffer_runs(q_chunks[call.q_lo:call.q_hi], L), spans):
                    if b - a > 1:
                        triangles.append((q0 + a, q0 + b - 1, k0 + a + 1, k0 + b))
        if triangles:
            out.append(_varlen_call(triangles, row, rows, True, qm, km, reverse=True))
        for q_lo, q_hi, k_lo, k_hi in uppers:
            keys = {s: (a, b) for s, a, b in span_pieces(buffer_runs(k_chunks[k_lo:k_hi], L), spans)}
            for s, a, b in span_pieces(buffer_runs(q_chunks[q_lo:q_hi], L), spans):
                if s in keys:
                    full.setdefault(row, []).append((q_lo * L + a, q_lo * L + b, k_lo * L + keys[s][0],
                                                     k_lo * L + keys[s][1]))


def _varlen_call(spans: list[tuple[int, int, int, int]], row: int | None, rows: int, causal: bool, qm: int,
                 km: int, *, reverse: bool = False) -> KernelCall:
    """Segments of one row (None: all rows), as buffer ranges (q_lo, q_hi, k_lo, k_hi): one ordinary call when there
    is one, else one varlen call over them all (``KernelCall.spans``; Note [Varlen calls on any kernel] in
    ``kernels/varlen.py``). Causal segments are diagonal ones, or with ``reverse`` strictly upper triangles
    (``KernelCall.reverse``: always a varlen call, which takes them in descending order)."""
    r = slice(0, rows) if row is None else slice(row, row + 1)
    n_rows = rows if row is None else 1
    work = n_rows * sum((b - a) * (b - a + 1) // 2 if causal else (b - a) * (d - c) for a, b, c, d in spans)
    q_lo, q_hi = min(x[0] for x in spans), max(x[1] for x in spans)
    k_lo, k_hi = min(x[2] for x in spans), max(x[3] for x in spans)
    rel = tuple((a - q_lo, b - q_lo, c - k_lo, d - k_lo) for a, b, c, d in spans)
    return KernelCall(r, slice(q_lo, q_hi), slice(k_lo, k_hi), causal, None, work, qm, km,
                      spans=rel if len(spans) > 1 or reverse else None, reverse=reverse)


def _masked_work(gq, gk, window: int) -> int:
    """Visible pairs 0 <= i - j < window between global index ranges (closed form per pair of ranges)."""
    total = 0
    for qa, qb in gq:
        for ka, kb in gk:
            for i in range(qa, qb):  # per query: keys in [max(ka, i - window + 1), min(kb, i + 1))
                total += max(0, min(kb, i + 1) - max(ka, i - window + 1))
    return total
