"""Many documents' attention in a few kernel calls, for any backend: a varlen call (``KernelCall.spans``: each span's
queries against its own keys, independently) runs as one batched call per span length class. The spans of a class
are gathered into one batch, each right-padded to the class lengths; padded keys are never seen by a real query
(causal masking on the diagonal, a key-padding mask otherwise), padded query rows are dropped, and their dO is zero
in the backward, so they add nothing to dk/dv (Note [Varlen calls on any kernel]).
"""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["length_class", "span_classes", "varlen_backward", "varlen_forward"]

_MIN = 16
"""The shortest class: shorter spans are padded to it."""
_EXACT = 512
"""Spans at least this long are their own class, padded only to a multiple of 8: their work dwarfs a call's cost,
and padding them up to a class would cost up to 2x their score entries."""


def length_class(n: int) -> int:
    """The padded length of a span of ``n`` tokens: from ``_EXACT`` on, ``n`` rounded up to a multiple of 8; below,
    the first of 16 * 2^(k/2), rounded up to a multiple of 8, that holds it (a short span computes at most about 2x
    the score entries it needs, 1.4x typically)."""
    if n >= _EXACT:
        return -(-n // 8) * 8
    k = 0
    while True:
        size = -(-math.ceil(_MIN * 2 ** (k / 2)) // 8) * 8
        if size >= n:
            return size
        k += 1


def _padded(lo: int, hi: int, size: int, reverse: bool = False) -> list[int]:
    if reverse:  # descending (Note [Bidirectional spans]); padding repeats the last position taken, ``lo``
        return list(range(hi - 1, lo - 1, -1)) + [lo] * (size - (hi - lo))
    return list(range(lo, hi)) + [hi - 1] * (size - (hi - lo))


@functools.lru_cache(maxsize=1024)
def span_classes(spans: tuple[tuple[int, int, int, int], ...], causal: bool, reverse: bool = False):
    """Pure: per length class, (query length, key length, the spans' query gather index [n * query length], their
    key gather index [n * key length], the real query rows in gather order, the real key rows in gather order).
    Causal spans are diagonal: one class length on both sides. Padding repeats a span's last position taken.
    ``reverse``: each span's queries and keys are taken in descending order (``blocks.KernelCall.reverse``)."""
    by: dict[tuple[int, int], list] = {}
    for a, b, c, d in spans:
        lq = length_class(b - a)
        by.setdefault((lq, lq) if causal else (lq, length_class(d - c)), []).append((a, b, c, d))
    out = []
    for (lq, lk), group in sorted(by.items()):
        qi, ki, q_real, k_real = [], [], [], []
        for a, b, c, d in group:
            q_real += range(len(qi), len(qi) + b - a)
            k_real += range(len(ki), len(ki) + d - c)
            qi += _padded(a, b, lq, reverse)
            ki += _padded(c, d, lk, reverse)
        out.append((lq, lk, tuple(qi), tuple(ki), tuple(q_real), tuple(k_real)))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _indices(spans, causal: bool, device: torch.device, reverse: bool = False):
    """``span_classes`` as tensors on ``device``: (query length, key length, n spans, query gather, key gather, real
    query rows, their positions, real key rows, their positions, key-padding mask [n, 1, 1, key length] or None)."""
    out = []
    for lq, lk, qi, ki, q_real, k_real in span_classes(spans, causal, reverse):
        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        qg, kg, qr, kr = t(qi), t(ki), t(q_real), t(k_real)
        n = len(qi) // lq
        mask = None
        if not causal:
            mask = torch.zeros(n * lk, dtype=torch.bool, device=device).index_fill_(0, kr, True).view(n, 1, 1, lk)
        out.append((lq, lk, n, qg, kg, qr, qg[qr], kr, kg[kr], mask))
    return tuple(out)


def _batched(x: torch.Tensor, gather: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """[B, h, S, ...] -> the spans as a batch [B * n, h, size, ...]."""
    g = x.index_select(2, gather).unflatten(2, (n, size))  # [B, h, n, size, ...]
    return g.movedim(2, 1).flatten(0, 1)


def _unbatched(y: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse layout of ``_batched``: [B * n, h, size, ...] -> [B, h, n * size, ...]."""
    return y.unflatten(0, (b, -1)).movedim(1, 2).flatten(2, 3)


def varlen_forward(forward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans, *, causal: bool,
                   reverse: bool = False):
    """(out [B, hq, Sq, dv], lse [B, hq, Sq] fp32) of each span's queries against its keys (rows in no span: out 0,
    lse -inf); ``forward(q, k, v, mask)`` is the backend's call on a batch (causal when ``causal``; ``mask`` a
    key-padding mask, or None); ``reverse``: the spans taken in descending order (``span_classes``)."""
    b, hq, s, _ = q.shape
    out = lse = None
    for lq, lk, n, qg, kg, qr, qpos, _, _, mask in _indices(tuple(spans), causal, q.device, reverse):
        o, l = forward(_batched(q, qg, n, lq), _batched(k, kg, n, lk), _batched(v, kg, n, lk),
                       None if mask is None else mask.repeat(b, 1, 1, 1))
        if out is None:
            out = torch.zeros((b, hq, s, o.shape[-1]), dtype=o.dtype, device=q.device)
            lse = torch.full((b, hq, s), float("-inf"), dtype=torch.float32, device=q.device)
        out.index_copy_(2, qpos, _unbatched(o, b).index_select(2, qr))
        lse.index_copy_(2, qpos, _unbatched(l.float(), b).index_select(2, qr))
    return out, lse


def varlen_backward(backward, dout, q, k, v, o, lse, spans, *, causal: bool, reverse: bool = False):
    """(dq, dk, dv) of ``varlen_forward``'s attention; ``backward(dout, q, k, v, o, lse, mask)`` is the backend's
    backward on a batch (``o``: out, or the fp32 delta [B, hq, S] of a kernel that takes it). dk/dv sum over the spans
    that share keys."""
    b = q.shape[0]
    grads = None
    for lq, lk, n, qg, kg, qr, qpos, kr, kpos, mask in _indices(tuple(spans), causal, q.device, reverse):
        keep = torch.zeros(n * lq, dtype=dout.dtype, device=dout.device).index_fill_(0, qr, 1)
        do = _batched(dout, qg, n, lq) * keep.view(n, lq).repeat(b, 1)[:, None, :, None]
        got = backward(do, _batched(q, qg, n, lq), _batched(k, kg, n, lk), _batched(v, kg, n, lk),
                       _batched(o, qg, n, lq), _batched(lse, qg, n, lq),
                       None if mask is None else mask.repeat(b, 1, 1, 1))
        if grads is None:
            grads = [torch.zeros((*x.shape[:3], g.shape[-1]), dtype=g.dtype, device=q.device)
                     for x, g in zip((q, k, v), got)]
        grads[0].index_copy_(2, qpos, _unbatched(got[0], b).index_select(2, qr))
        for acc, g in zip(grads[1:], got[1:]):
            acc.index_add_(2, kpos, _unbatched(g, b).index_select(2, kr))
    return tuple(grads)


# Note [Varlen calls on any kernel]: with short packed documents a block splits into one call per document: hundreds
# of calls per block, each paying a launch, slicing and an accumulator update. A varlen call covers them all:
# the diagonal's causal segments of a block as one call, the full (off-diagonal) segments as another.
# flash-attn's varlen functions would do it in one launch on the GPU; here, for every backend and on the CPU, the
# spans are batched by length class instead: short spans padded to the same lengths (classes a factor sqrt(2)
# apart, so padding at most doubles a short causal span's score entries) go through the backend's ordinary call as
# one batch; a span of 512 tokens or more is its own class, padded to a multiple of 8 only (padded to a class it
# could cost 2x its entries, and such spans carry most of a packed row's work: measured, rows of equal work then
# took up to 1.25x each other's time). Launches are at most about 11 classes of short spans plus one per long span,
# at most block length / 512: they do not grow with the number of documents. Right
# padding is exact: on the diagonal, causal masking keeps a real query at row i on keys 0..i, all real; off it, a
# key-padding mask [n, 1, 1, keys] hides the padded keys (backends without masks run such spans one by one). Padded
# query rows compute something and are dropped; in the backward their dO is zero, so their ds = p (dO.v - delta) is
# zero and they add nothing to dk and dv. The index tensors are cached per (spans, device): once per batch.
