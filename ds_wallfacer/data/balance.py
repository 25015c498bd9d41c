"""Attention work of packed documents and a chunk assignment that balances it, as pure integer math (no torch).

``balanced_assignment`` gives each of P ring ranks m of P x m equal chunks, minimising the largest rank's attention
work (``chunk_work``, ``rank_work``: score entries, summed per document segment in closed form); integers and
fixed tie-breaks only, so every rank computes the same answer. ``zigzag_assignment`` is the layout it improves on.

Design: Note [Balanced sharding of packed documents] in docs/design/documents.md (work, algorithm, measured balance).
"""
from __future__ import annotations

import bisect
import heapq
import math
from typing import Iterable, Sequence

__all__ = [
    "Assignment",
    "balance_ratio",
    "balanced_assignment",
    "balanced_assignment_from_work",
    "check_assignment",
    "chunk_work",
    "rank_work",
    "segment_work",
    "zigzag_assignment",
]

Assignment = tuple[tuple[int, ...], ...]
"""Per rank, the ids of the chunks it holds, ascending."""


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window = {window!r} is invalid: give a positive number of keys, or None for full attention")


def _prefix_work(x: int, window: int | None) -> int:
    """Work of a document's first ``x`` tokens: sum over k < x of min(k + 1, window)."""
    if window is None or x <= window:
        return x * (x + 1) // 2
    return window * (window + 1) // 2 + (x - window) * window


def segment_work(start: int, stop: int, *, window: int | None = None) -> int:
    """Work of the tokens at positions ``start .. stop - 1`` inside one document (closed form)."""
    _check_window(window)
    if not 0 <= start <= stop:
        raise ValueError(f"segment [{start}, {stop}) is invalid: need 0 <= start <= stop")
    return _prefix_work(stop, window) - _prefix_work(start, window)


def _check_lengths(doc_lengths: Sequence[int], what: str) -> int:
    total = 0
    for length in doc_lengths:
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise ValueError(f"{what}: document length {length!r} is invalid: lengths are non-negative integers")
        total += length
    return total


def _check_chunks(n: int, num_chunks: int, what: str) -> int:
    if num_chunks < 1:
        raise ValueError(f"the number of chunks must be positive; got {num_chunks}")
    if n <= 0 or n % num_chunks:
        lo = n - n % num_chunks
        raise ValueError(
            f"{what}: sequence length {n} is not divisible into {num_chunks} equal chunks: pad to "
            f"{lo + num_chunks}" + (f" or truncate to {lo}" if lo else "")
        )
    return n // num_chunks


def chunk_work(doc_lengths: Sequence[int], *, num_chunks: int, window: int | None = None) -> tuple[int, ...]:
    """Work of each of ``num_chunks`` equal chunks of one row whose documents have ``doc_lengths`` (in order,
    summing to the row length). O(documents + chunks)."""
    _check_window(window)
    n = _check_lengths(doc_lengths, "chunk_work")
    size = _check_chunks(n, num_chunks, "chunk_work")
    works = [0] * num_chunks
    start = 0
    for length in doc_lengths:
        end = start + length
        c = start // size
        while c * size < end:
            lo, hi = max(start, c * size), min(end, (c + 1) * size)
            works[c] += _prefix_work(hi - start, window) - _prefix_work(lo - start, window)
            c += 1
        start = end
    return tuple(works)


def _batch_chunk_work(rows: Sequence[Sequence[int]], num_chunks: int, window: int | None) -> list[int]:
    if not rows:
        raise ValueError("no rows: give the document lengths of at least one row")
    lengths = [_check_lengths(r, f"row {i}") for i, r in enumerate(rows)]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"rows have different lengths {lengths}: every row of a batch must hold the same number of tokens "
            "(count the right padding as one more document)"
        )
    total = [0] * num_chunks
    for row in rows:
        for c, w in enumerate(chunk_work(row, num_chunks=num_chunks, window=window)):
            total[c] += w
    return total


def check_assignment(assignment: Sequence[Sequence[int]], *, num_chunks: int | None = None) -> int:
    """Raise unless every rank holds the same number of chunks and every chunk 0..n-1 is held exactly once.
    Returns the chunks per rank."""
    if not assignment:
        raise ValueError("an assignment needs at least one rank")
    counts = {len(a) for a in assignment}
    if len(counts) != 1 or 0 in counts:
        counts_seen = [len(a) for a in assignment]
        raise ValueError(f"every rank must hold the same positive number of chunks; got counts {counts_seen}")
    held = sorted(int(c) for a in assignment for c in a)
    n = len(held) if num_chunks is None else num_chunks
    if held != list(range(n)):
        raise ValueError(f"the assignment must hold every chunk 0..{n - 1} exactly once; it holds {held}")
    return counts.pop()


def rank_work(
    doc_lengths_per_row: Sequence[Sequence[int]], assignment: Sequence[Sequence[int]], *, window: int | None = None
) -> tuple[int, ...]:
    """Work of each rank under ``assignment`` (per rank its chunk ids of n = sum of counts), summed over rows."""
    _check_window(window)
    n = sum(len(a) for a in assignment)
    check_assignment(assignment, num_chunks=n)
    work = _batch_chunk_work(doc_lengths_per_row, n, window)
    return tuple(sum(work[c] for c in a) for a in assignment)


def balance_ratio(work_per_rank: Iterable[int | float]) -> float:
    """max / mean of the work per rank: 1.0 is perfect balance; the step waits for the busiest rank."""
    w = list(work_per_rank)
    if not w:
        raise ValueError("balance_ratio needs the work of at least one rank")
    mean = sum(w) / len(w)
    return 1.0 if mean == 0 else max(w) / mean


def zigzag_assignment(sp_size: int) -> Assignment:
    """Today's layout in assignment form: rank i holds chunks (i, 2P-1-i) of 2P."""
    if sp_size < 1:
        raise ValueError(f"sp_size must be positive; got {sp_size}")
    return tuple((i, 2 * sp_size - 1 - i) for i in range(sp_size))


# -- the search --------------------------------------------------------------------------------------


def _lpt(work: Sequence[int], p: int, m: int) -> list[list[int]]:
    """Largest chunk first, onto the least loaded rank that still has room (ties: lower rank, lower chunk)."""
    order = sorted(range(len(work)), key=lambda c: (-work[c], c))
    heap = [(0, r) for r in range(p)]
    bins: list[list[int]] = [[] for _ in range(p)]
    for c in order:
        load, r = heapq.heappop(heap)
        bins[r].append(c)
        if len(bins[r]) < m:
            heapq.heappush(heap, (load + work[c], r))
    return bins


def _refined_zigzag(p: int, m: int) -> list[list[int]]:
    """Zigzag's chunks (i, 2P-1-i) of 2P, each cut into m / 2 of the n = P x m chunks (m even)."""
    half = m // 2
    return [[z * half + k for z in (i, 2 * p - 1 - i) for k in range(half)] for i in range(p)]


def _improve(bins: list[list[int]], work: Sequence[int], *, max_rounds: int) -> list[list[int]]:
    """Swap one chunk of the heaviest rank with one of a lighter rank while that lowers the heaviest rank's
    load without lifting the other to it; best swap per round. Each swap lowers the sorted load vector, so it
    ends; ``max_rounds`` bounds the time."""
    items = [sorted((work[c], c) for c in b) for b in bins]
    loads = [sum(w for w, _ in it) for it in items]
    floor = -(-sum(loads) // len(loads))  # no assignment has a busiest rank below the mean
    for _ in range(max_rounds):
        h = max(range(len(loads)), key=lambda r: (loads[r], -r))
        if loads[h] <= floor:
            break
        best: tuple[int, int, int, int] | None = None  # (new pair max, rank j, item of h, item of j)
        for j in sorted(range(len(loads)), key=lambda r: (loads[r], r)):
            gap = loads[h] - loads[j]
            if gap <= 0 or (best is not None and loads[h] - gap // 2 >= best[0]):
                break  # ranks are visited lightest first: no later one can beat the best swap found
            wj = [w for w, _ in items[j]]
            for a_i, (a, _) in enumerate(items[h]):
                k = bisect.bisect_left(wj, a - gap // 2)
                for b_i in (k - 1, k):
                    if 0 <= b_i < len(wj) and 0 < a - wj[b_i] < gap:
                        d = a - wj[b_i]
                        cand = (max(loads[h] - d, loads[j] + d), j, a_i, b_i)
                        if best is None or cand < best:
                            best = cand
        if best is None:
            break
        _, j, a_i, b_i = best
        a, b = items[h].pop(a_i), items[j].pop(b_i)
        bisect.insort(items[h], b)
        bisect.insort(items[j], a)
        loads[h] += b[0] - a[0]
        loads[j] += a[0] - b[0]
    return [[c for _, c in it] for it in items]


def balanced_assignment_from_work(work: Sequence[int], *, sp_size: int, chunks_per_rank: int) -> Assignment:
    """``balanced_assignment`` for given per-chunk work (n = sp_size x chunks_per_rank values)."""
    p, m = sp_size, chunks_per_rank
    if p < 1 or m < 1:
        raise ValueError(f"sp_size ({p}) and chunks_per_rank ({m}) must be positive")
    if len(work) != p * m:
        raise ValueError(f"{len(work)} chunk works given for sp_size x chunks_per_rank = {p} x {m} = {p * m} chunks")

    def key(bins: list[list[int]]) -> tuple[int, ...]:
        return tuple(sorted((sum(work[c] for c in b) for b in bins), reverse=True))

    best = _improve(_lpt(work, p, m), work, max_rounds=4 * p * m)
    if m % 2 == 0:
        # zigzag refined to these chunks is a valid layout too: never return worse (searched only when it wins)
        zigzag = _refined_zigzag(p, m)
        if key(zigzag)[0] < key(best)[0]:
            best = min(best, _improve(zigzag, work, max_rounds=4 * p * m), key=key)
    return tuple(tuple(sorted(b)) for b in best)


def balanced_assignment(
    doc_lengths_per_row: Sequence[Sequence[int]],
    *,
    sp_size: int,
    chunks_per_rank: int,
    window: int | None = None,
) -> Assignment:
    """Which chunks each of ``sp_size`` ranks holds so that the busiest rank's attention work is small.

    ``doc_lengths_per_row``: per row of the batch, its documents' lengths in order, summing to the row length N
    (the same for every row; right padding counts as one more document). The row is cut into
    n = sp_size x chunks_per_rank equal chunks (N must be divisible by n); each rank gets exactly
    ``chunks_per_rank`` of them, the same for every row. Returns per rank its chunk ids, ascending.
    """
    _check_window(window)
    n = sp_size * chunks_per_rank
    if sp_size < 1 or chunks_per_rank < 1:
        raise ValueError(f"sp_size ({sp_size}) and chunks_per_rank ({chunks_per_rank}) must be positive")
    if doc_lengths_per_row:
        _check_chunks(_check_lengths(doc_lengths_per_row[0], "row 0"), n,
                      f"sp_size x chunks_per_rank = {sp_size} x {chunks_per_rank}")
    work = _batch_chunk_work(doc_lengths_per_row, n, window)
    return balanced_assignment_from_work(work, sp_size=sp_size, chunks_per_rank=chunks_per_rank)
