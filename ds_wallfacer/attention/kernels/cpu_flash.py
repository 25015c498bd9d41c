"""PyTorch's fused CPU flash-attention kernel (returns the log-sum-exp; grouped-query attention native; masks as
an additive bias). It has no logit soft-capping: the reference kernel does that on CPU."""
from __future__ import annotations

import torch

__all__ = ["CpuFlashKernel"]

_aten = torch.ops.aten


def _with_causal(mask: torch.Tensor | None, causal: bool) -> tuple[torch.Tensor | None, bool]:
    """Fold ``causal`` into a mask (so rows that see nothing can be found), or keep the op's own causal path."""
    if mask is None or not causal:
        return mask, causal
    sq, sk = mask.shape[-2:]
    return mask & torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril(), False


def _bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Bool keep-mask -> the additive bias the op takes (its dtype must be the query's)."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class CpuFlashKernel:
    name = "cpu_flash"
    supports_mask = True
    supports_softcap = False

    def supports(self, q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        if softcap:
            raise ValueError("attention kernel 'cpu_flash' cannot apply attention logit soft-capping")
        mask, causal = _with_causal(mask, causal)
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale
        )
        lse = lse.float()
        if mask is not None:  # the op reports lse 0 for a row that sees no key; the merge needs -inf
            lse = lse.masked_fill(~mask.any(dim=-1).expand_as(lse), float("-inf"))
        return out, lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        if softcap:
            raise ValueError("attention kernel 'cpu_flash' cannot apply attention logit soft-capping")
        mask, causal = _with_causal(mask, causal)
        lse = lse.to(torch.float64) if q.dtype == torch.float64 else lse
        if mask is not None:
            lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that see nothing: probabilities exp(-inf) = 0
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, attn_mask=_bias(mask, q.dtype), scale=scale
        )
