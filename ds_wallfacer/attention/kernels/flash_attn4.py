"""flash-attn-4 (CuTe DSL kernels, module ``flash_attn.cute``), when installed; Hopper and Blackwell (sm90+),
fp16/bf16. Its layout is [B, S, h, d]; grouped-query attention and logit soft-capping (forward and backward) are
native. Kernels are compiled just in time on first use of each configuration, so the first call of each is slow.

The quirks of its private ``_flash_attn_fwd/_bwd`` and its head dims: Note [flash-attn-4 interface] in
docs/design/dependencies.md.
"""
from __future__ import annotations

import functools

import torch

from ._signature import Signature
from .base import check_options

__all__ = ["FlashAttn4Kernel", "flash_attn4_available"]


@functools.lru_cache(maxsize=None)
def _functions() -> tuple[Signature, Signature] | None:
    """The probed (forward, backward), or None when flash-attn-4 is missing, broken or too old."""
    try:
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except Exception:  # noqa: BLE001 - any import failure (no wheel, no CUTLASS DSL) means "not available"
        return None
    fwd, bwd = Signature(_flash_attn_fwd), Signature(_flash_attn_bwd)
    if "return_lse" not in fwd or "lse" not in bwd:
        return None
    return fwd, bwd


def _head_dim_ok(major: int, d: int) -> bool:
    if d % 8:
        return False
    return d <= 128 or d == 256 or (major == 9 and d <= 256)


def flash_attn4_available() -> bool:
    return torch.cuda.is_available() and _functions() is not None


class FlashAttn4Kernel:
    """The import and the signature probe run once per process, the device check once per kernel object."""

    name = "flash_attn4"
    supports_mask = False
    supports_softcap = True

    def __init__(self) -> None:
        self._major: dict[int, int] = {}

    def supports(self, q: torch.Tensor) -> bool:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if idx not in self._major:
            self._major[idx] = torch.cuda.get_device_capability(idx)[0]
        major = self._major[idx]
        return major >= 9 and _head_dim_ok(major, q.shape[-1]) and _functions() is not None

    def _sigs(self) -> tuple[Signature, Signature]:
        fns = _functions()
        if fns is None:
            raise RuntimeError("attention kernel 'flash_attn4' needs flash-attn-4 (pip install flash-attn-4)")
        return fns

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        fwd, _ = self._sigs()
        res = fwd.call(
            q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), softmax_scale=scale, causal=causal,
            softcap=float(softcap) if softcap else None, return_lse=True,
        )
        out, lse = res[0], res[1]  # [B, S, h, d], [B, h, S]
        if lse is None:
            raise RuntimeError("flash-attn-4 returned no log-sum-exp although return_lse=True was passed")
        return out.transpose(1, 2), lse.float().contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        _, bwd = self._sigs()
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        res = bwd.call(
            q=qt, k=kt, v=vt, out=out.to(q.dtype).transpose(1, 2).contiguous(),
            dout=dout.to(q.dtype).transpose(1, 2).contiguous(), lse=lse.contiguous(), softmax_scale=scale,
            causal=causal, softcap=float(softcap), deterministic=False,
        )
        dq, dk, dv = res[0], res[1], res[2]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
