"""Bidirectional spans in a block call, as pure integer math (no torch): the key chunks after a run of query chunks
(``upper_runs``: where a span can cross above the causal diagonal), each span's piece of a buffer (``span_pieces``),
and the off-diagonal spans of one row grouped into varlen calls whose query rows do not overlap
(``full_layers``). ``blocks.kernel_calls`` builds the calls with them.

Design: Note [Bidirectional spans] in docs/design/spans.md.
"""
from __future__ import annotations

import bisect
from typing import Sequence

__all__ = ["full_layers", "span_pieces", "upper_runs"]


def upper_runs(q_chunks: Sequence[int], k_chunks: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """For sorted disjoint chunk lists: (q_lo, q_hi, k_lo, k_hi) list indices of every run of query chunks with the
    same key chunks after them, and those keys (a suffix of ``k_chunks``); runs with no key after them are left out.
    The mirror of ``blocks.block_calls``, whose calls take the keys before."""
    nk, runs = len(k_chunks), []
    for qi, c in enumerate(q_chunks):
        before = bisect.bisect_left(k_chunks, c)
        if before == nk:
            continue
        if runs and runs[-1][2] == before and runs[-1][1] == qi:
            runs[-1] = (runs[-1][0], qi + 1, before, nk)
        else:
            runs.append((qi, qi + 1, before, nk))
    return runs


def span_pieces(runs: list[tuple[int, int, int]], spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Per span present in a buffer of sorted chunks (``blocks.buffer_runs``: (buffer offset, global start, length)
    per run): (span index, buffer lo, buffer hi). A span is an interval of the sequence, so its tokens in the buffer
    are one range (the chunks between two held ones are absent, never interleaved)."""
    out: list[list[int]] = []
    starts = [a for a, _ in spans]
    for off, g0, n in runs:
        s = max(0, bisect.bisect_right(starts, g0) - 1)
        while s < len(spans) and spans[s][0] < g0 + n:
            a, b = spans[s]
            lo, hi = max(a, g0), min(b, g0 + n)
            if lo < hi:
                if out and out[-1][0] == s and out[-1][2] == off + lo - g0:
                    out[-1][2] = off + hi - g0
                else:
                    out.append([s, off + lo - g0, off + hi - g0])
            s += 1
    return [(s, lo, hi) for s, lo, hi in out]


def full_layers(spans: list[tuple[int, int, int, int]]) -> list[list[tuple[int, int, int, int]]]:
    """Full spans (q_lo, q_hi, k_lo, k_hi) of one row -> lists of spans whose query rows are disjoint, each one
    varlen call. Spans that share query rows arise only from bidirectional spans (a span row's keys before its chunk
    and its span's keys after it); where the shared rows' key ranges touch, which they do there, they become one
    span, so the row keeps one call; key ranges that do not touch go to further lists. Spans already disjoint in
    their queries come back as they are, in their order. One sweep over the query boundaries."""
    ordered = sorted(spans)
    if all(a[1] <= b[0] for a, b in zip(ordered, ordered[1:])):
        return [spans]
    bounds = sorted({x for a, b, _, _ in spans for x in (a, b)})
    layers: list[list[list[int]]] = []
    active: list[tuple[int, int, int, int]] = []
    at = 0
    for lo, hi in zip(bounds, bounds[1:]):
        active = [x for x in active if x[1] > lo]
        while at < len(ordered) and ordered[at][0] == lo:
            active.append(ordered[at])
            at += 1
        for i, (c, d) in enumerate(_joined(sorted((c, d) for _, _, c, d in active), lo, hi, spans)):
            if i == len(layers):
                layers.append([])
            last = layers[i][-1] if layers[i] else None
            if last is not None and last[1] == lo and (last[2], last[3]) == (c, d):
                last[1] = hi
            else:
                layers[i].append([lo, hi, c, d])
    return [[tuple(x) for x in layer] for layer in layers]


def _joined(keys: list[tuple[int, int]], lo: int, hi: int, spans) -> list[list[int]]:
    """Sorted key ranges of the queries [lo, hi), touching ones joined; a key counted twice is refused."""
    joined: list[list[int]] = []
    for c, d in keys:
        if joined and c <= joined[-1][1]:
            if c < joined[-1][1]:
                raise ValueError(f"full spans {spans} count a key twice for the queries [{lo}, {hi})")
            joined[-1][1] = d
        else:
            joined.append([c, d])
    return joined
