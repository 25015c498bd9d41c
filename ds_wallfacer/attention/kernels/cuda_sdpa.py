"""PyTorch's CUDA SDPA kernels, called at the op level to get (out, lse) and a backward from a given lse.

fp16/bf16 use the flash kernel (kv heads expanded locally for GQA, after communication); fp32 uses the
memory-efficient kernel. Dropout is never used, so the RNG state tensors are placeholders.
"""
from __future__ import annotations

import torch

from .base import check_options, expand_kv, reduce_kv_grad

__all__ = ["CudaSdpaKernel"]

_aten = torch.ops.aten


class CudaSdpaKernel:
    name = "cuda_sdpa"
    supports_mask = False
    supports_softcap = False

    def supports(self, q: torch.Tensor) -> bool:
        return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16, torch.float32)

    @staticmethod
    def _flash(q: torch.Tensor) -> bool:
        return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        hq, sq = q.shape[1], q.shape[2]
        k, v = expand_kv(k, hq), expand_kv(v, hq)
        if self._flash(q):
            out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        else:
            out, lse, *_ = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        return out, lse[..., :sq].float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        hk, hq, sq, sk = k.shape[1], q.shape[1], q.shape[2], k.shape[2]
        ke, ve = expand_kv(k, hq), expand_kv(v, hq)
        dout, out = dout.to(q.dtype).contiguous(), out.to(q.dtype).contiguous()
        if self._flash(q):
            rng = torch.zeros(2, dtype=torch.int64, device=q.device)
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                dout, q, ke, ve, out, lse.contiguous(), None, None, sq, sk, 0.0, causal, rng, rng, scale=scale
            )
        else:
            pad = (-sq) % 32  # the efficient kernel's lse rows are padded to a multiple of 32
            lse_p = torch.nn.functional.pad(lse, (0, pad)).contiguous() if pad else lse.contiguous()
            seed = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
                dout, q, ke, ve, None, out, lse_p, seed, seed, 0.0, [True, True, True, False], causal, scale=scale
            )
        return dq, reduce_kv_grad(dk, hk), reduce_kv_grad(dv, hk)
