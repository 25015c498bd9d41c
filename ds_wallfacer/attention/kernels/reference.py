"""Plain-PyTorch block attention: the numerical reference the tests trust, and the CPU path for what the fused
CPU kernel cannot do (logit soft-capping). Scores are materialised for ``_ROWS`` queries at a time, so memory
stays O(rows x Sk) rather than O(Sq x Sk)."""
from __future__ import annotations

import torch

from .base import expand_kv, reduce_kv_grad

__all__ = ["ReferenceKernel"]

_ROWS = 1024
"""Query rows per score tile."""


def _tile_mask(mask: torch.Tensor | None, rows: slice, causal: bool, sq: int, sk: int, device) -> torch.Tensor | None:
    """The keep-mask of query rows ``rows``: causal (top-left aligned) and the caller's mask; None = keep all."""
    keep = None
    if causal:
        i = torch.arange(rows.start, rows.stop, device=device).unsqueeze(-1)
        keep = torch.arange(sk, device=device) <= i  # [r, Sk]
    if mask is not None:
        m = mask[..., rows, :] if mask.shape[-2] == sq and sq > 1 else mask
        keep = m if keep is None else keep & m
    return keep


def _scores(q: torch.Tensor, k: torch.Tensor, keep: torch.Tensor | None, *, scale: float, softcap: float):
    """Logits [B, hq, r, Sk] in float32 (float64 for float64 inputs), soft-capped, masked with -inf; also the
    tanh of the capped logits (for the backward), or None."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(q.to(dt), expand_kv(k, q.shape[1]).to(dt).transpose(-1, -2)) * scale
    t = None
    if softcap:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s, t


class ReferenceKernel:
    """Computes in float32 (float64 for float64 inputs); any device, any dtype, masks and soft-capping."""

    name = "reference"
    supports_mask = True
    supports_softcap = True
    supports_value_dim = True

    def supports(self, q: torch.Tensor) -> bool:
        return True

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        b, hq, sq, _ = q.shape
        sk = k.shape[2]
        out = torch.empty((*q.shape[:3], v.shape[-1]), dtype=q.dtype, device=q.device)
        lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
        ve = expand_kv(v, hq)
        for r0 in range(0, sq, _ROWS):
            rows = slice(r0, min(r0 + _ROWS, sq))
            keep = _tile_mask(mask, rows, causal, sq, sk, q.device)
            s, _ = _scores(q[:, :, rows], k, keep, scale=scale, softcap=softcap)
            l = torch.logsumexp(s, dim=-1)
            p = torch.exp(s - torch.where(torch.isinf(l), torch.zeros_like(l), l).unsqueeze(-1))
            out[:, :, rows] = torch.matmul(p, ve.to(p.dtype)).to(q.dtype)
            lse[:, :, rows] = l.float()
        return out, lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        hk, hq, sq, sk = k.shape[1], q.shape[1], q.shape[2], k.shape[2]
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        ke, ve = expand_kv(k, hq).to(dt), expand_kv(v, hq).to(dt)
        dq = torch.empty(q.shape, dtype=dt, device=q.device)
        dk = torch.zeros(ke.shape, dtype=dt, device=q.device)
        dv = torch.zeros(ve.shape, dtype=dt, device=q.device)
        for r0 in range(0, sq, _ROWS):
            rows = slice(r0, min(r0 + _ROWS, sq))
            keep = _tile_mask(mask, rows, causal, sq, sk, q.device)
            s, t = _scores(q[:, :, rows], k, keep, scale=scale, softcap=softcap)
            l = lse[:, :, rows].to(dt)
            p = torch.exp(s - torch.where(torch.isinf(l), torch.zeros_like(l), l).unsqueeze(-1))  # final lse
            do = dout[:, :, rows].to(dt)
            dv += torch.matmul(p.transpose(-1, -2), do)
            dp = torch.matmul(do, ve.transpose(-1, -2))
            delta = (do * out[:, :, rows].to(dt)).sum(-1, keepdim=True)
            ds = p * (dp - delta)
            if softcap:
                ds = ds * (1 - t * t)  # d(c tanh(x / c)) / dx
            ds = ds * scale
            dq[:, :, rows] = torch.matmul(ds, ke)
            dk += torch.matmul(ds.transpose(-1, -2), q[:, :, rows].to(dt))
        return dq, reduce_kv_grad(dk, hk), reduce_kv_grad(dv, hk)
