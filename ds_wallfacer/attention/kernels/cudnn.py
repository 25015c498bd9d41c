"""cuDNN's fused attention through PyTorch's op ``aten._scaled_dot_product_cudnn_attention`` (and its
``_backward``), called at the op level to get (out, lse) and a backward from a given out and lse; CUDA, fp16/bf16.
Grouped-query attention: kv heads are expanded locally; a bool keep-mask becomes the op's additive bias.

The op's quirks (finite bias, lse rank, alignment, the probe that declines a build or device):
Note [cuDNN attention op] in docs/design/dependencies.md.
"""
from __future__ import annotations

import warnings

import torch

from .base import check_options, expand_kv, reduce_kv_grad

__all__ = ["CudnnKernel", "cudnn_attention_available"]

_aten = torch.ops.aten
_DROPPED = -65504.0
"""Additive bias of a position a query may not see (finite: Note [cuDNN attention op] in docs/design/dependencies.md)."""
_lse_rank: int | None = None
"""Rank of the lse this build's forward op returns (3 or 4), once known."""


def cudnn_attention_available() -> bool:
    """The op exists in this torch build and CUDA with cuDNN is present (whether it runs is probed per device)."""
    return (
        hasattr(_aten, "_scaled_dot_product_cudnn_attention")
        and hasattr(_aten, "_scaled_dot_product_cudnn_attention_backward")
        and torch.cuda.is_available()
        and torch.backends.cudnn.is_available()
    )


def lse_rank() -> int:
    """The rank of the forward op's lse: the first real call's, else this build's meta kernel's."""
    global _lse_rank
    if _lse_rank is None:
        q = torch.empty(1, 1, 8, 64, device="meta", dtype=torch.bfloat16)
        try:
            _lse_rank = _aten._scaled_dot_product_cudnn_attention(q, q, q, None, True, 0.0, False, False,
                                                                  scale=1.0)[1].dim()
        except Exception:  # noqa: BLE001 - no meta kernel in this build: the long-standing [B, h, S, 1]
            return 4
    return _lse_rank


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)) if mask.dim() < 4 else mask


def _bias(mask: torch.Tensor, causal: bool, q: torch.Tensor, sk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool keep-mask -> (additive bias [B, Hm, Sq, Sk] in q's dtype, 16-element aligned rows; bool [Bm, Hm, Sq]:
    whether each query row sees any key, causal included)."""
    b, _, sq, _ = q.shape
    m = _as_4d(mask)
    m = m.expand(m.shape[0], m.shape[1], sq, sk)
    pad = -sk % 16
    bias = torch.zeros(m.shape[0], m.shape[1], sq, sk + pad, dtype=q.dtype, device=q.device)[..., :sk]
    bias.masked_fill_(~m, _DROPPED)
    seen = m & torch.ones(sq, sk, dtype=torch.bool, device=m.device).tril() if causal else m
    return bias.expand(b, m.shape[1], sq, sk), seen.any(dim=-1)


_probed: dict[tuple, tuple[bool, bool]] = {}
"""(device index, dtype, head dim) -> (the op agrees with the reference, its bias path does too)."""


def _self_test(device: torch.device, dtype: torch.dtype, d: int) -> tuple[bool, bool]:
    """A tiny grouped-query forward + backward against the reference kernel: causal without a mask, then a
    keep-mask with a row that sees nothing. Returns (usable, masks usable); says why once when not."""
    from .reference import ReferenceKernel

    kern, ref, scale = CudnnKernel(), ReferenceKernel(), d**-0.5
    g = torch.Generator(device=device).manual_seed(0)
    q, do = (torch.randn(1, 2, 128, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, 1, 128, d, generator=g, device=device, dtype=dtype) for _ in range(2))
    i = torch.arange(128, device=device)
    keep = (i[:, None] - i[None, :]).abs() < 32
    keep[5] = False

    def agrees(causal: bool, mask: torch.Tensor | None) -> bool:
        want = ref.forward(q, k, v, causal=causal, scale=scale, mask=mask)
        want = [*want, *ref.backward(do, q, k, v, *want, causal=causal, scale=scale, mask=mask)]
        got = kern.forward(q, k, v, causal=causal, scale=scale, mask=mask)
        got = [*got, *kern.backward(do, q, k, v, *got, causal=causal, scale=scale, mask=mask)]
        for a, b in zip(got, want):
            a, b = a.float(), b.float()
            fin = torch.isfinite(b)
            if not torch.equal(torch.isinf(a), torch.isinf(b)) or not torch.isfinite(a[fin]).all():
                return False
            if (a[fin] - b[fin]).abs().max() > 0.1:  # bf16 errors are ~1e-2 here; a wrong lse is O(1)
                return False
        return True

    where = f"{device} ({dtype}, head dim {d})"
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            if not agrees(True, None):
                warnings.warn(f"cuDNN attention disagrees with the reference kernel on {where}: not used", stacklevel=4)
                return False, False
            if not agrees(False, keep):
                warnings.warn(f"cuDNN attention with a mask disagrees with the reference kernel on {where}: masked "
                              "attention goes to another kernel", stacklevel=4)
                return True, False
    except Exception as e:  # noqa: BLE001 - the op missing from this build or device: decline, say why once
        warnings.warn(f"cuDNN attention is not usable on {where}: {type(e).__name__}: {e}"[:300], stacklevel=4)
        return False, False
    return True, True


class CudnnKernel:
    name = "cudnn"
    supports_mask = True
    """Through the op's additive bias; an object on a device whose bias-path self-test failed sets its own False."""
    supports_softcap = False

    def supports(self, q: torch.Tensor) -> bool:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        d = q.shape[-1]
        if d % 8 or d > 128:
            return False
        idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
        key = (idx, q.dtype, d)
        if key not in _probed:
            usable = cudnn_attention_available() and torch.cuda.get_device_capability(idx) >= (8, 0)
            _probed[key] = _self_test(torch.device("cuda", idx), q.dtype, d) if usable else (False, False)
        ok, mask_ok = _probed[key]
        if ok and not mask_ok:
            self.supports_mask = False
        return ok

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        global _lse_rank
        check_options(self, mask=mask, softcap=softcap)
        b, hq, sq, _ = q.shape
        sk = k.shape[2]
        bias, seen = _bias(mask, causal, q, sk) if mask is not None else (None, None)
        res = _aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), expand_kv(k, hq).contiguous(), expand_kv(v, hq).contiguous(), bias, True, 0.0, causal,
            False, scale=scale,
        )
        out, lse = res[0], res[1]
        _lse_rank = lse.dim()
        lse = lse.reshape(b, hq, sq).float()
        if seen is not None:
            out = out.masked_fill(~seen.unsqueeze(-1), 0.0)
            lse = lse.masked_fill(~seen, float("-inf"))
        return out, lse.contiguous()

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        b, hq, sq, _ = q.shape
        hk, sk = k.shape[1], k.shape[2]
        bias = _bias(mask, causal, q, sk)[0] if mask is not None else None
        lse = lse.float()
        if mask is not None:
            lse = lse.masked_fill(torch.isinf(lse), 0.0)  # rows that see nothing: exp(-65504 - 0) = 0
        lse = lse.reshape((b, hq, sq, 1) if lse_rank() == 4 else (b, hq, sq)).contiguous()
        seed = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout.to(q.dtype).contiguous(), q.contiguous(), expand_kv(k, hq).contiguous(), expand_kv(v, hq).contiguous(),
            out.to(q.dtype).contiguous(), lse, seed, seed, bias, None, None, sq, sk, 0.0, causal, scale=scale,
        )
        return dq, reduce_kv_grad(dk, hk), reduce_kv_grad(dv, hk)
