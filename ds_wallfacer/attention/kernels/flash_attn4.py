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
from .bshd import BSHDKernel

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


class FlashAttn4Kernel(BSHDKernel):
    """Hopper and Blackwell (sm90+); the import and the signature probe run once per process, the device check once
    per kernel object."""

    name = "flash_attn4"
    missing = "flash-attn-4 (pip install flash-attn-4)"
    probe = staticmethod(lambda: _functions())

    def runs_on(self, major: int, head_dim: int) -> bool:
        return major >= 9 and _head_dim_ok(major, head_dim)

    def call_forward(self, fwd, q, k, v, *, causal, scale, softcap):
        res = fwd.call(q=q, k=k, v=v, softmax_scale=scale, causal=causal,
                       softcap=float(softcap) if softcap else None, return_lse=True)
        out, lse = res[0], res[1]
        if lse is None:
            raise RuntimeError("flash-attn-4 returned no log-sum-exp although return_lse=True was passed")
        return out, lse

    def call_backward(self, bwd, dout, q, k, v, out, lse, *, causal, scale, softcap):
        res = bwd.call(q=q, k=k, v=v, out=out, dout=dout, lse=lse, softmax_scale=scale, causal=causal,
                       softcap=float(softcap), deterministic=False)
        return res[0], res[1], res[2]
