"""flash-attn (Dao-AILab) 2.x, when installed (``pip install ds_wallfacer[flash]``); CUDA, fp16/bf16.

flash-attn's own layout is [B, S, h, d] and it handles grouped-query attention natively. Its private
``_flash_attn_forward/_backward`` signatures changed across 2.x releases; that quirk lives here only.
"""
from __future__ import annotations

import inspect

import torch

__all__ = ["FlashAttnKernel", "flash_attn_available"]


def flash_attn_available() -> bool:
    try:
        import flash_attn.flash_attn_interface  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return torch.cuda.is_available()


def _call(fn, **kwargs):
    """Pass only the keyword arguments this flash-attn version's function accepts."""
    params = inspect.signature(fn).parameters
    if "window_size" in params and "window_size_left" in kwargs:
        kwargs["window_size"] = (kwargs.pop("window_size_left"), kwargs.pop("window_size_right"))
    return fn(**{k: v for k, v in kwargs.items() if k in params})


class FlashAttnKernel:
    name = "flash_attn"

    def supports(self, q: torch.Tensor) -> bool:
        return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and flash_attn_available()

    def forward(self, q, k, v, *, causal, scale):
        from flash_attn.flash_attn_interface import _flash_attn_forward

        res = _call(
            _flash_attn_forward,
            q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), dropout_p=0.0,
            softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False,
        )
        out, lse = res[0], res[1]  # [B, S, h, d], [B, h, S]
        return out.transpose(1, 2), lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        from flash_attn.flash_attn_interface import _flash_attn_backward

        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        _call(
            _flash_attn_backward,
            dout=dout.to(q.dtype).transpose(1, 2).contiguous(), q=qt, k=kt, v=vt,
            out=out.to(q.dtype).transpose(1, 2).contiguous(), softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
            dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
