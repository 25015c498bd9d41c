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
from .bshd import BSHDKernel

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


def flash_attn3_available() -> bool:
    return torch.cuda.is_available() and _functions() is not None


class FlashAttn3Kernel(BSHDKernel):
    """Hopper (sm90), head dims multiple of 8 up to 256; the import and the signature probe run once per process,
    the device check once per kernel object."""

    name = "flash_attn3"
    missing = "FlashAttention-3 (flash_attn_interface, built from the flash-attn repository's hopper/ directory)"
    probe = staticmethod(lambda: _functions())

    def runs_on(self, major: int, head_dim: int) -> bool:
        return major == 9 and head_dim % 8 == 0 and head_dim <= 256

    def call_forward(self, fwd, q, k, v, *, causal, scale, softcap):
        res = fwd.call(
            q=q, k=k, v=v, softmax_scale=scale, causal=causal,
            window_size=(-1, -1), window_size_left=-1, window_size_right=-1, attention_chunk=0,
            softcap=float(softcap), rotary_interleaved=True, num_splits=1, pack_gqa=None, sm_margin=0,
            sink_token_length=0,
        )
        return res[0], res[1]

    def call_backward(self, bwd, dout, q, k, v, out, lse, *, causal, scale, softcap):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        bwd.call(
            dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            softmax_scale=scale, causal=causal, is_causal=causal, window_size=(-1, -1), window_size_left=-1,
            window_size_right=-1, softcap=float(softcap), deterministic=False, sm_margin=0, sink_token_length=0,
        )
        return dq, dk, dv
