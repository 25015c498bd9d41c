"""FlashAttention-3 (the flash-attn repository's ``hopper/`` build, module ``flash_attn_interface``), when
installed; Hopper (sm90) only, fp16/bf16. Its layout is [B, S, h, d]; grouped-query attention and logit
soft-capping (forward and backward) are native.

The quirks of its private ``_flash_attn_forward/_backward`` across releases: Note [FlashAttention-3 interface] in
docs/design/dependencies.md.
"""
from __future__ import annotations

import functools

import torch

from ._signature import Signature
from .base import check_options

__all__ = ["FlashAttn3Kernel", "flash_attn3_available"]


@functools.lru_cache(maxsize=None)
def _functions() -> tuple[Signature, Signature] | None:
    """The probed (forward, backward), or None when FlashAttention-3 is missing, broken or too old."""
    try:
        from flash_attn_interface import _flash_attn_backward, _flash_attn_forward
    except Exception:  # noqa: BLE001 - any import failure (no build, ABI mismatch) means "not available"
        return None
    fwd, bwd = Signature(_flash_attn_forward), Signature(_flash_attn_backward)
    if "cu_seqlens_q" not in fwd or "softmax_lse" not in bwd:
        return None
    return fwd, bwd


def _hopper(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] == 9


def flash_attn3_available() -> bool:
    return torch.cuda.is_available() and _functions() is not None


class FlashAttn3Kernel:
    """The import and the signature probe run once per process, the device check once per kernel object."""

    name = "flash_attn3"
    supports_mask = False
    supports_softcap = True

    def __init__(self) -> None:
        self._devices: dict[int, bool] = {}

    def supports(self, q: torch.Tensor) -> bool:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        if q.shape[-1] % 8 or q.shape[-1] > 256:
            return False
        idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if idx not in self._devices:
            self._devices[idx] = _hopper(torch.device("cuda", idx)) and _functions() is not None
        return self._devices[idx]

    def _sigs(self) -> tuple[Signature, Signature]:
        fns = _functions()
        if fns is None:
            raise RuntimeError("attention kernel 'flash_attn3' needs FlashAttention-3 (flash_attn_interface, built "
                               "from the flash-attn repository's hopper/ directory)")
        return fns

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        fwd, _ = self._sigs()
        res = fwd.call(
            q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), softmax_scale=scale, causal=causal,
            window_size=(-1, -1), window_size_left=-1, window_size_right=-1, attention_chunk=0,
            softcap=float(softcap), rotary_interleaved=True, num_splits=1, pack_gqa=None, sm_margin=0,
            sink_token_length=0,
        )
        out, lse = res[0], res[1]  # [B, S, h, d], [B, h, S]
        return out.transpose(1, 2), lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        _, bwd = self._sigs()
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        bwd.call(
            dout=dout.to(q.dtype).transpose(1, 2).contiguous(), q=qt, k=kt, v=vt,
            out=out.to(q.dtype).transpose(1, 2).contiguous(), softmax_lse=lse.contiguous(), dq=dq, dk=dk, dv=dv,
            softmax_scale=scale, causal=causal, is_causal=causal, window_size=(-1, -1), window_size_left=-1,
            window_size_right=-1, softcap=float(softcap), deterministic=False, sm_margin=0, sink_token_length=0,
        )
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
