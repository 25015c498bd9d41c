"""PyTorch's fused CPU flash-attention kernel (returns the log-sum-exp; grouped-query attention native)."""
from __future__ import annotations

import torch

__all__ = ["CpuFlashKernel"]

_aten = torch.ops.aten


class CpuFlashKernel:
    name = "cpu_flash"

    def supports(self, q: torch.Tensor) -> bool:
        return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)

    def forward(self, q, k, v, *, causal, scale):
        out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        lse = lse.to(torch.float64) if q.dtype == torch.float64 else lse
        return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal, scale=scale
        )
