"""Plain-PyTorch block attention: the numerical reference the tests trust (materialises scores)."""
from __future__ import annotations

import torch

from .base import expand_kv, reduce_kv_grad

__all__ = ["ReferenceKernel"]


def _scores(q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float) -> torch.Tensor:
    s = torch.matmul(q.float(), expand_kv(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if causal:
        sq, sk = s.shape[-2:]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(mask, float("-inf"))
    return s  # [B, hq, Sq, Sk] float32


class ReferenceKernel:
    """Computes in float32 (float64 for float64 inputs); any device, any dtype."""

    name = "reference"

    def supports(self, q: torch.Tensor) -> bool:
        return True

    def forward(self, q, k, v, *, causal, scale):
        s = _scores(q.double() if q.dtype == torch.float64 else q, k, causal=causal, scale=scale)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))
        out = torch.matmul(p, expand_kv(v, q.shape[1]).to(p.dtype))
        return out.to(q.dtype), lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        hk = k.shape[1]
        s = _scores(q, k, causal=causal, scale=scale)
        p = torch.exp(s - lse.unsqueeze(-1))  # final lse: probabilities of the full attention
        do, ve = dout.float(), expand_kv(v, q.shape[1]).float()
        dv = torch.matmul(p.transpose(-1, -2), do)
        dp = torch.matmul(do, ve.transpose(-1, -2))
        delta = (do * out.float()).sum(-1, keepdim=True)
        ds = p * (dp - delta) * scale
        dq = torch.matmul(ds, expand_kv(k, q.shape[1]).float())
        dk = torch.matmul(ds.transpose(-1, -2), q.float())
        return dq, reduce_kv_grad(dk, hk), reduce_kv_grad(dv, hk)
