"""The reference attention for the tests: full inputs from a seed, a float64 single-process attention, shard errors.

Every rank builds the same full-sequence inputs from a seed, runs the single-process reference on them,
and compares its own shard of the result with what the distributed attention returned.
"""
from __future__ import annotations

import torch

__all__ = ["document_mask", "full_inputs", "reference_attention", "shard_errors", "span_mask"]


def full_inputs(
    *, batch: int, q_heads: int, kv_heads: int, seq_len: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
    device: str | torch.device = "cpu", value_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unit-scale q, k, v and an output gradient dO for the full sequence, identical on every rank; v and dO have
    ``value_dim`` columns (None: ``head_dim``)."""
    g = torch.Generator().manual_seed(seed)
    dv = head_dim if value_dim is None else value_dim

    def mk(h: int, d: int = head_dim) -> torch.Tensor:
        return torch.randn(batch, h, seq_len, d, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    return mk(q_heads), mk(kv_heads), mk(kv_heads, dv), mk(q_heads, dv)


def reference_attention(
    q, k, v, dout, *, causal: bool, scale: float | None = None, dtype=torch.float64, keep=None, softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
):
    """Full attention by autograd in ``dtype`` (float64: the ground truth): (out, dq, dk, dv), and d sinks last when
    ``sinks`` [hq] are given (gpt-oss: one logit per head joins each row's softmax as a column without a value).
    ``keep``: a bool mask [B, 1, N, N] on top of ``causal`` (documents, windows); ``softcap``: logit soft-capping."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    s_h = None if sinks is None else sinks.detach().to(dtype).requires_grad_()
    rep = q.shape[1] // k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if s_h is not None:  # the sink column, dropped after the softmax
        s = torch.cat([s, s_h.view(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    p = torch.softmax(s, -1)
    out = torch.matmul(p if s_h is None else p[..., :-1], v.repeat_interleave(rep, 1))
    out.backward(dout.to(dtype))
    grads = (q.grad, k.grad, v.grad) + (() if s_h is None else (s_h.grad,))
    return (out.detach(), *grads)


def shard_errors(got: list[torch.Tensor], want_full: list[torch.Tensor], shard_fn) -> list[float]:
    """Max abs error of each local result against ``shard_fn(full reference)``."""
    return [(g.double() - shard_fn(w).double()).abs().max().item() for g, w in zip(got, want_full)]


def document_mask(doc_lengths: list[list[int]], *, window: int | None = None) -> torch.Tensor:
    """[B, 1, N, N] bool: query i may see key j iff both are in the same document (and i - j < window)."""
    rows = []
    for lengths in doc_lengths:
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        m = ids[:, None] == ids[None, :]
        if window is not None:
            i = torch.arange(len(ids))
            m &= (i[:, None] - i[None, :]) < window
        rows.append(m)
    return torch.stack(rows).unsqueeze(1)


def span_mask(doc_lengths: list[list[int]], spans: list[list[tuple[int, int]]], *, window: int | None = None
              ) -> torch.Tensor:
    """[B, 1, N, N] bool, the whole mask (use with ``causal=False``): key j visible from query i iff both are in one
    document, i - j < window, and j <= i or both lie in one bidirectional span [start, end) of the row: HF's
    AND(sliding window, OR(causal, blockwise)) of Gemma 3, written out pair by pair."""
    rows = []
    for lengths, row_spans in zip(doc_lengths, spans):
        n = sum(lengths)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        i = torch.arange(n)
        span = torch.full((n,), -1)
        for s, (a, b) in enumerate(row_spans):
            span[a:b] = s
        m = (i[None, :] <= i[:, None]) | ((span[:, None] == span[None, :]) & (span[:, None] >= 0))
        m &= ids[:, None] == ids[None, :]
        if window is not None:
            m &= (i[:, None] - i[None, :]) < window
        rows.append(m)
    return torch.stack(rows).unsqueeze(1)
