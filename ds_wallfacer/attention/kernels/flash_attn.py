"""flash-attn (Dao-AILab) 2.x, when installed (``pip install ds_wallfacer[flash]``); CUDA, fp16/bf16.

flash-attn's own layout is [B, S, h, d] and it handles grouped-query attention natively. Logit soft-capping is
native from 2.6 on (``softcap``, forward and backward). Quirks of its private ``_flash_attn_forward/_backward``
that live here only:

- 2.5 / 2.6 take ``window_size=(left, right)``; 2.7+ take ``window_size_left`` / ``window_size_right``;
- 2.5 / 2.6 return (out, q, k, v, out_padded, lse, S_dmask, rng_state); 2.7+ return (out, lse, S_dmask, rng_state);
- 2.7+ wrap both in ``torch.library.custom_op``, whose signature reads ``(*args, **kwargs)``
  (``_signature.Signature`` reads the wrapped function);
- the backward writes into the dq, dk, dv it is given (2.7+ return only ``softmax_d``).
"""
from __future__ import annotations

import torch

from ._signature import Signature
from .base import check_options

__all__ = ["FlashAttnKernel", "flash_attn_available"]


def flash_attn_available() -> bool:
    try:
        import flash_attn.flash_attn_interface  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return torch.cuda.is_available()


def _lse(res: tuple) -> torch.Tensor:
    """The log-sum-exp in either return layout (see the module docstring)."""
    return res[5] if len(res) == 8 else res[1]


class FlashAttnKernel:
    """The signature probe and the availability check run once per kernel object (the attention layers keep
    theirs), not per call."""

    name = "flash_attn"
    supports_mask = False
    supports_softcap = True
    """From flash-attn 2.6 on (the ``[flash]`` extra's floor); an older release refuses a softcap by name."""

    def __init__(self) -> None:
        self._available: bool | None = None
        self._fwd: Signature | None = None
        self._bwd: Signature | None = None

    def supports(self, q: torch.Tensor) -> bool:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        if q.shape[-1] % 8 or q.shape[-1] > 256:  # the private functions do not pad the head dim
            return False
        if self._available is None:
            self._available = flash_attn_available()
        return self._available

    def _forward_fn(self) -> Signature:
        if self._fwd is None:
            from flash_attn.flash_attn_interface import _flash_attn_forward

            self._fwd = Signature(_flash_attn_forward)
        return self._fwd

    def _backward_fn(self) -> Signature:
        if self._bwd is None:
            from flash_attn.flash_attn_interface import _flash_attn_backward

            self._bwd = Signature(_flash_attn_backward)
        return self._bwd

    @staticmethod
    def _check_softcap(sig: Signature, softcap: float) -> None:
        if softcap and "softcap" not in sig:
            raise ValueError("attention kernel 'flash_attn' needs flash-attn >= 2.6 for logit soft-capping")

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        sig = self._forward_fn()
        self._check_softcap(sig, softcap)
        res = sig.call(
            q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale,
            causal=causal, window_size=(-1, -1), window_size_left=-1, window_size_right=-1, softcap=float(softcap),
            alibi_slopes=None, return_softmax=False,
        )
        out = res[0]  # [B, S, h, d]; lse [B, h, S]
        return out.transpose(1, 2), _lse(res).float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        sig = self._backward_fn()
        self._check_softcap(sig, softcap)
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        sig.call(
            dout=dout.to(q.dtype).transpose(1, 2).contiguous(), q=qt, k=kt, v=vt,
            out=out.to(q.dtype).transpose(1, 2).contiguous(), softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
            dropout_p=0.0, softmax_scale=scale, causal=causal, window_size=(-1, -1), window_size_left=-1,
            window_size_right=-1, softcap=float(softcap), alibi_slopes=None, deterministic=False, rng_state=None,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
