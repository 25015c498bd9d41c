"""Many documents' causal attention in a few kernel calls, for any backend: a varlen call (``KernelCall.spans``:
causal attention inside each span of a buffer range, independently) runs as one batched call per span length class.
The spans of a class are gathered into one batch, each right-padded to the class length; causal masking keeps
every real query off the padding keys, the padded query rows are dropped, and their dO is zero in the backward, so
they add nothing to dk/dv (Note [Varlen calls on any kernel]).
"""
from __future__ import annotations

import functools
import math

import torch

__all__ = ["length_class", "span_classes", "varlen_backward", "varlen_forward"]

_MIN = 16
"""The shortest class: shorter spans are padded to it."""


def length_class(n: int) -> int:
    """The padded length of a span of ``n`` tokens: the first of 16 * 2^(k/2), rounded up to a multiple of 8, that
    holds it (a span computes at most about 2x the score entries it needs, 1.4x typically)."""
    k = 0
    while True:
        size = -(-math.ceil(_MIN * 2 ** (k / 2)) // 8) * 8
        if size >= n:
            return size
        k += 1


@functools.lru_cache(maxsize=1024)
def span_classes(spans: tuple[tuple[int, int], ...]) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]:
    """Pure: per length class (ascending), (padded length, the gather index of its spans [n * padded], the
    positions of the gathered rows that are real, in gather order). Padding repeats a span's last position."""
    by: dict[int, list[tuple[int, int]]] = {}
    for lo, hi in spans:
        by.setdefault(length_class(hi - lo), []).append((lo, hi))
    out = []
    for size in sorted(by):
        idx, real = [], []
        for lo, hi in by[size]:
            base = len(idx)
            idx += list(range(lo, hi)) + [hi - 1] * (size - (hi - lo))
            real += range(base, base + hi - lo)
        out.append((size, tuple(idx), tuple(real)))
    return tuple(out)


@functools.lru_cache(maxsize=1024)
def _indices(spans: tuple[tuple[int, int], ...], device: torch.device):
    """``span_classes`` as index tensors on ``device``: (size, n spans, gather index, real rows, their positions)."""
    out = []
    for size, idx, real in span_classes(spans):
        gather = torch.tensor(idx, dtype=torch.long, device=device)
        rows = torch.tensor(real, dtype=torch.long, device=device)
        out.append((size, len(idx) // size, gather, rows, gather[rows]))
    return tuple(out)


def _batched(x: torch.Tensor, gather: torch.Tensor, n: int, size: int) -> torch.Tensor:
    """[B, h, S, ...] -> the spans as a batch [B * n, h, size, ...]."""
    g = x.index_select(2, gather).unflatten(2, (n, size))  # [B, h, n, size, ...]
    return g.movedim(2, 1).flatten(0, 1)


def _unbatched(y: torch.Tensor, b: int) -> torch.Tensor:
    """Inverse layout of ``_batched``: [B * n, h, size, ...] -> [B, h, n * size, ...]."""
    y = y.unflatten(0, (b, -1)).movedim(1, 2)
    return y.flatten(2, 3)


def varlen_forward(forward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spans):
    """(out [B, hq, S, dv], lse [B, hq, S] fp32) of causal attention inside each span; ``forward(q, k, v)`` is the
    backend's causal forward on a batch."""
    b, hq, s, _ = q.shape
    out = lse = None
    for size, n, gather, rows, pos in _indices(tuple(spans), q.device):
        o, l = forward(*(_batched(x, gather, n, size) for x in (q, k, v)))
        if out is None:
            out = torch.empty((b, hq, s, o.shape[-1]), dtype=o.dtype, device=q.device)
            lse = torch.empty((b, hq, s), dtype=torch.float32, device=q.device)
        out.index_copy_(2, pos, _unbatched(o, b).index_select(2, rows))
        lse.index_copy_(2, pos, _unbatched(l.float(), b).index_select(2, rows))
    return out, lse


def varlen_backward(backward, dout, q, k, v, o, lse, spans):
    """(dq, dk, dv) of ``varlen_forward``'s attention; ``backward(dout, q, k, v, o, lse)`` is the backend's causal
    backward on a batch (``o``: out, or the fp32 delta [B, hq, S] of a kernel that takes it)."""
    b = q.shape[0]
    grads = None
    for size, n, gather, rows, pos in _indices(tuple(spans), q.device):
        keep = torch.zeros(n * size, dtype=dout.dtype, device=dout.device).index_fill_(0, rows, 1)
        do = _batched(dout, gather, n, size) * keep.view(n, size).repeat(b, 1)[:, None, :, None]
        got = backward(do, *(_batched(x, gather, n, size) for x in (q, k, v, o, lse)))
        if grads is None:
            grads = [torch.empty((*x.shape[:2], q.shape[2], g.shape[-1]), dtype=g.dtype, device=q.device)
                     for x, g in zip((q, k, v), got)]
        for acc, g in zip(grads, got):
            acc.index_copy_(2, pos, _unbatched(g, b).index_select(2, rows))
    return tuple(grads)


# Note [Varlen calls on any kernel]: with short packed documents a block's diagonal splits into one causal call per
# document: hundreds of calls per block, each paying a launch, slicing and an accumulator update. A varlen call
# covers them all. flash-attn's varlen functions do it in one launch on the GPU; for every backend (and on the CPU)
# the spans are batched by length class instead: spans padded to the same length (classes a factor sqrt(2) apart,
# so padding at most doubles a span's score entries) go through the backend's ordinary causal call as one batch.
# Calls per block then grow with the number of length classes (about 2 log2(longest / shortest)), not documents.
# Right padding is exact under causal masking: a real query at row i < n sees keys 0..i only, all real. The padded
# query rows compute something and are dropped; in the backward their dO is zero, so their ds = p * (dO.v - delta)
# is zero and they add nothing to dk and dv. The landing index tensors are cached per (spans, device), once per
# batch.
