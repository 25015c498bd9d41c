"""Running one planned kernel call (``blocks.KernelCall``) on its slices: an ordinary call, a window-masked one, or
a varlen call over many documents (``kernels/varlen.py``), forward and backward, for every runtime (ring and
WallFacer in ``wallfacer.py``, the direct fetch in ``direct.py``, local attention in ``local.py``).
"""
from __future__ import annotations

import torch

from .kernels import BlockKernel
from .kernels.base import expand_kv, window_mask
from .kernels.varlen import varlen_backward, varlen_forward
from .blocks import KernelCall

__all__ = ["call_backward", "call_forward", "expand_grads"]


def call_forward(kernel: BlockKernel, call: KernelCall, q, k, v, *, scale: float, window: int | None,
                 softcap: float):
    """(out, lse) of ``call`` on q, k, v already cut to its rows and ranges."""
    if call.spans is not None:
        if not call.causal and not kernel.supports_mask:  # no key-padding mask: the spans one by one
            return _one_by_one(lambda a, b, c: kernel.forward(a, b, c, causal=False, scale=scale, softcap=softcap),
                               q, k, v, call.spans)
        return varlen_forward(lambda a, b, c, m: kernel.forward(a, b, c, causal=call.causal, scale=scale, mask=m,
                                                                softcap=softcap),
                              q, k, v, call.spans, causal=call.causal, reverse=call.reverse)
    mask = None if call.mask is None else window_mask(call.mask, window, q.device)
    return kernel.forward(q, k, v, causal=call.causal, scale=scale, mask=mask, softcap=softcap)


def expand_grads(kernel: BlockKernel, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether block backward calls get k/v expanded to the query heads (Note [Gradients of grouped heads] in
    ``wallfacer.py``)."""
    return (q.shape[1] != k.shape[1] and q.dtype not in (torch.float32, torch.float64)
            and not getattr(kernel, "reduces_heads_in_fp32", False))


def call_backward(kernel: BlockKernel, call: KernelCall, expand: bool, do, q, k, v, out, lse, *, scale: float,
                  window: int | None, softcap: float, delta=None):
    """(dq, dk, dv) of ``call`` on its slices; dk/dv fp32 sums over each kv head's query heads when ``expand``.
    ``delta``: rowsum(dO * out) for a kernel with ``backward_delta`` (then ``out`` is None)."""
    if call.spans is not None:
        def one(do_, q_, k_, v_, o_, lse_, m=None):
            return _grads(kernel, expand, do_, q_, k_, v_, None if delta is not None else o_, lse_,
                          delta=o_ if delta is not None else None, causal=call.causal, scale=scale, mask=m,
                          softcap=softcap)
        o = out if delta is None else delta
        if not call.causal and not kernel.supports_mask:
            return _one_by_one(one, q, k, v, call.spans, grads=(do, o, lse))
        return varlen_backward(one, do, q, k, v, o, lse, call.spans, causal=call.causal, reverse=call.reverse)
    mask = None if call.mask is None else window_mask(call.mask, window, q.device)
    return _grads(kernel, expand, do, q, k, v, out, lse, delta=delta, causal=call.causal, scale=scale, mask=mask,
                  softcap=softcap)


def _one_by_one(fn, q, k, v, spans, *, grads=None):
    """A varlen call as one ordinary call per span: (out, lse) of ``fn(q, k, v)``, or with ``grads`` = (dO, out,
    lse) the (dq, dk, dv) of ``fn(dO, q, k, v, out, lse)``, on the call's whole ranges (rows in no span: nothing)."""
    res = None
    for a, b, c, d in spans:
        qa, ka, va = q[:, :, a:b], k[:, :, c:d], v[:, :, c:d]
        got = fn(qa, ka, va) if grads is None else fn(grads[0][:, :, a:b], qa, ka, va, grads[1][:, :, a:b],
                                                      grads[2][:, :, a:b])
        if res is None:
            if grads is None:
                res = (torch.zeros((*q.shape[:3], got[0].shape[-1]), dtype=got[0].dtype, device=q.device),
                       torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device))
            else:
                res = tuple(torch.zeros((*x.shape[:3], g.shape[-1]), dtype=g.dtype, device=q.device)
                            for x, g in zip((q, k, v), got))
        if grads is None:
            res[0][:, :, a:b] = got[0]
            res[1][:, :, a:b] = got[1]
        else:
            res[0][:, :, a:b] = got[0]
            res[1][:, :, c:d] += got[1]
            res[2][:, :, c:d] += got[2]
    return res


def _grads(kernel: BlockKernel, expand: bool, do, q, k, v, out, lse, *, delta=None, **options):
    hq, hk = q.shape[1], k.shape[1]
    if expand:
        k, v = expand_kv(k, hq), expand_kv(v, hq)
    if delta is not None:
        dq, dk, dv = kernel.backward_delta(do, q, k, v, delta, lse, **options)
    else:
        dq, dk, dv = kernel.backward(do, q, k, v, out, lse, **options)
    if expand:  # [B, hq, S, d] -> [B, hk, hq/hk, S, d] -> fp32 sum over the group
        dk = dk.unflatten(1, (hk, hq // hk)).sum(2, dtype=torch.float32)
        dv = dv.unflatten(1, (hk, hq // hk)).sum(2, dtype=torch.float32)
    return dq, dk, dv
