"""Attention over a whole sequence on one rank: ``LocalAttention`` (a one-rank group, and Ulysses' inner attention
over the gathered sequence) and the functions that run it, with packed documents, windows and sinks
(``local_calls``, ``local_forward``, ``local_backward``). Shapes as in ``ulysses.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .calls import call_backward, call_forward
from .documents import SequenceBatch
from .kernels import get_kernel
from .merge import merge_
from .residuals import residual_slot, tensor_key
from .blocks import BlockCall, kernel_calls
from .sinks import add_sink, sink_grad

__all__ = ["LocalAttention", "local_backward", "local_calls", "local_forward"]


def local_calls(rows: int, n: int, causal: bool, batch: SequenceBatch | None, window: int | None):
    """Kernel calls over a whole (gathered, in-order) sequence of ``n`` tokens in ``rows`` batch rows: one, or one per
    document segment / window tile (None: the single plain call)."""
    docs = batch.documents if batch is not None else None
    if docs is None and window is None:
        return None
    return kernel_calls([0], [0], [BlockCall(0, 1, 0, 1, causal)], chunk_len=n, rows=rows, docs=docs, window=window,
                        causal=causal)


@torch.no_grad()
def local_forward(q, k, v, sinks, kernel, causal: bool, scale: float, calls, window, softcap: float):
    """(out, lse) over the whole sequence: one kernel call, or fp32-merged calls per document segment / window tile
    (rows that see nothing stay at lse -inf); with ``sinks``, added to the merged rows before they are rounded."""
    if calls is None:
        out, lse = kernel.forward(q, k, v, causal=causal, scale=scale, softcap=softcap)
        return (out, lse) if sinks is None else add_sink(out, lse, sinks)
    acc = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for c in calls:
        o, l = call_forward(kernel, c, q[c.rows, :, c.qs], k[c.rows, :, c.ks], v[c.rows, :, c.ks], scale=scale,
                            window=window, softcap=softcap)
        merge_(acc[c.rows, :, c.qs], lse[c.rows, :, c.qs], o, l)
    if sinks is not None:
        acc, lse = add_sink(acc, lse, sinks)
    return acc.to(q.dtype), lse


class _LocalFn(torch.autograd.Function):
    """Attention over the whole sequence on this rank. Inside a checkpointed layer the first forward keeps
    (out, lse) and the recompute returns them without running the kernel (``residuals.py``). With ``sinks``, out
    and lse include them (Note [Attention sinks], docs/design/attention.md)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel, causal: bool, scale: float, calls, window, softcap: float):
        ctx.has_sinks = has_sinks = sinks is not None
        key = tensor_key(q, k, v, *([sinks] if has_sinks else []))
        ctx.slot = slot = residual_slot("local", kernel, key, causal, scale, calls, window, softcap)
        if slot is not None and slot.replaying:
            out, lse = slot.take()
        else:
            out, lse = local_forward(q, k, v, sinks, kernel, causal, scale, calls, window, softcap)
            if slot is not None:
                slot.keep(out, lse)
        ctx.save_for_backward(q, k, v, out, lse, *([sinks] if has_sinks else []))
        ctx.kernel, ctx.causal, ctx.scale, ctx.calls = kernel, causal, scale, calls
        ctx.window, ctx.softcap = window, softcap
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *sinks = ctx.saved_tensors
        dout = dout.to(q.dtype)  # its layout as it comes: the kernels take strided tensors (no copy of dO)
        dsinks = sink_grad(dout, out, lse, sinks[0]) if sinks else None
        dq, dk, dv = local_backward(dout, q, k, v, out, lse, ctx.kernel, ctx.causal, ctx.scale, ctx.calls, ctx.window,
                                    ctx.softcap)
        if ctx.slot is not None:
            ctx.slot.done()
        return dq, dk, dv, dsinks, None, None, None, None, None, None


@torch.no_grad()
def local_backward(dout, q, k, v, out, lse, kernel, causal: bool, scale: float, calls, window, softcap: float):
    """(dq, dk, dv) in the inputs' dtypes of ``local_forward``'s attention (out and lse with the sinks, if any)."""
    if calls is None:
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=causal, scale=scale, softcap=softcap)
    else:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        for c in calls:
            gq, gk, gv = call_backward(
                kernel, c, False, dout[c.rows, :, c.qs], q[c.rows, :, c.qs], k[c.rows, :, c.ks], v[c.rows, :, c.ks],
                out[c.rows, :, c.qs], lse[c.rows, :, c.qs], scale=scale, window=window, softcap=softcap,
            )
            dq[c.rows, :, c.qs] += gq
            dk[c.rows, :, c.ks] += gk
            dv[c.rows, :, c.ks] += gv
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@dataclass(eq=False)
class LocalAttention:
    """Attention over the whole (gathered) sequence on one rank, with a block kernel from the registry."""

    kernel: str = "auto"
    """Kernel backend name (``ds_wallfacer.attention.KERNELS``) or "auto"."""
    _kernels: dict = field(default_factory=dict, repr=False)
    """Chosen kernel per (device type, dtype): chosen once, not per call."""

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
        batch: SequenceBatch | None = None, window: int | None = None, softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        softcap = float(softcap or 0.0)
        calls = local_calls(q.shape[0], q.shape[2], causal, batch, window)
        return _LocalFn.apply(q, k, v, sinks, self.kernel_for(q, v, window, softcap), causal, scale, calls, window,
                              softcap)

    def kernel_for(self, q: torch.Tensor, v: torch.Tensor, window: int | None, softcap: float):
        """The block kernel for q's device and dtype and what the layer needs, chosen once per combination."""
        value_dim = v.shape[-1] != q.shape[-1]
        key = (q.device.type, q.dtype, window is not None, bool(softcap), value_dim)
        if key not in self._kernels:
            self._kernels[key] = get_kernel(self.kernel, q, mask=window is not None, softcap=bool(softcap),
                                            value_dim=value_dim)
        return self._kernels[key]
