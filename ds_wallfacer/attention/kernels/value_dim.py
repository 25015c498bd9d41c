"""Value heads narrower (or wider) than query/key heads (multi-head latent attention: DeepSeek-V3's 128 vs 192)
for backends whose kernels need one head dim: ``ValueDimKernel`` pads q, k, v, out and dO with zeros to the larger
dim on this rank, after communication (nothing padded travels), and slices the results back.

Exact by construction: zero columns of q and k add nothing to q.k (the scale is passed explicitly, never read from
the padded dim); zero columns of v give zero output columns, which add nothing to rowsum(dO * out) in the backward;
the gradients of the padded columns are dropped.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BlockKernel

__all__ = ["ValueDimKernel", "with_value_dim"]


def _pad(x: torch.Tensor | None, d: int) -> torch.Tensor | None:
    return x if x is None or x.shape[-1] == d else F.pad(x, (0, d - x.shape[-1]))


class ValueDimKernel:
    """``kernel`` for v head dims unlike q/k's: pads locally when they differ, calls through when they agree."""

    supports_value_dim = True

    def __init__(self, kernel: BlockKernel) -> None:
        self.inner = kernel
        self.name = kernel.name
        self.supports_mask = kernel.supports_mask
        self.supports_softcap = kernel.supports_softcap
        self.reduces_heads_in_fp32 = getattr(kernel, "reduces_heads_in_fp32", False)

    def supports(self, q: torch.Tensor) -> bool:
        return self.inner.supports(q)

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv:
            return self.inner.forward(q, k, v, causal=causal, scale=scale, mask=mask, softcap=softcap)
        d = max(dqk, dv)
        out, lse = self.inner.forward(_pad(q, d), _pad(k, d), _pad(v, d), causal=causal, scale=scale, mask=mask,
                                      softcap=softcap)
        return out[..., :dv], lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        dqk, dv = q.shape[-1], v.shape[-1]
        if dqk == dv:
            return self.inner.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, mask=mask, softcap=softcap)
        d = max(dqk, dv)
        gq, gk, gv = self.inner.backward(_pad(dout, d), _pad(q, d), _pad(k, d), _pad(v, d), _pad(out, d), lse,
                                         causal=causal, scale=scale, mask=mask, softcap=softcap)
        return gq[..., :dqk], gk[..., :dqk], gv[..., :dv]


def with_value_dim(kernel: BlockKernel) -> BlockKernel:
    """``kernel`` itself when it takes any v head dim (``supports_value_dim``), else wrapped to pad locally."""
    return kernel if getattr(kernel, "supports_value_dim", False) else ValueDimKernel(kernel)
