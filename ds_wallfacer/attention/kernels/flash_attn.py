"""flash-attn (Dao-AILab) 2.x, when installed (``pip install ds_wallfacer[flash]``); CUDA, fp16/bf16.

flash-attn's own layout is [B, S, h, d] and it handles grouped-query attention natively. Its private
``_flash_attn_forward/_backward`` signatures changed across 2.x releases; that quirk lives here only.
"""
from __future__ import annotations

import inspect

import torch

from .base import check_options

__all__ = ["FlashAttnKernel", "flash_attn_available"]


def flash_attn_available() -> bool:
    try:
        import flash_attn.flash_attn_interface  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return torch.cuda.is_available()


def _call(fn, params: frozenset[str], **kwargs):
    """Pass only the keyword arguments (``params``: those this flash-attn version's ``fn`` accepts)."""
    if "window_size" in params and "window_size_left" in kwargs:
        kwargs["window_size"] = (kwargs.pop("window_size_left"), kwargs.pop("window_size_right"))
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _params(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


class FlashAttnKernel:
    """The signature probe and the availability check run once per kernel object (the attention layers keep
    theirs), not per call."""

    name = "flash_attn"
    supports_mask = False
    supports_softcap = False

    def __init__(self) -> None:
        self._available: bool | None = None
        self._fwd: tuple | None = None
        self._bwd: tuple | None = None

    def supports(self, q: torch.Tensor) -> bool:
        if self._available is None:
            self._available = flash_attn_available()
        return q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and self._available

    def _forward_fn(self) -> tuple:
        if self._fwd is None:
            from flash_attn.flash_attn_interface import _flash_attn_forward

            self._fwd = (_flash_attn_forward, _params(_flash_attn_forward))
        return self._fwd

    def _backward_fn(self) -> tuple:
        if self._bwd is None:
            from flash_attn.flash_attn_interface import _flash_attn_backward

            self._bwd = (_flash_attn_backward, _params(_flash_attn_backward))
        return self._bwd

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        res = _call(
            *self._forward_fn(),
            q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), dropout_p=0.0,
            softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
            alibi_slopes=None, return_softmax=False,
        )
        out, lse = res[0], res[1]  # [B, S, h, d], [B, h, S]
        return out.transpose(1, 2), lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        _call(
            *self._backward_fn(),
            dout=dout.to(q.dtype).transpose(1, 2).contiguous(), q=qt, k=kt, v=vt,
            out=out.to(q.dtype).transpose(1, 2).contiguous(), softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
            dropout_p=0.0, softmax_scale=scale, causal=causal, window_size_left=-1, window_size_right=-1,
            softcap=0.0, alibi_slopes=None, deterministic=False, rng_state=None,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
