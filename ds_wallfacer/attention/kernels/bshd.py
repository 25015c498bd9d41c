"""The skeleton the FlashAttention adapters share (FlashAttention-3 in ``flash_attn3.py``, flash-attn-4 in
``flash_attn4.py``): their private forward/backward take [B, S, h, d], are probed once per process (a ``Signature``
pair, or None when missing or too old), run on some compute capabilities and head dims only, and take grouped-query
attention and soft-capping natively but no mask. A backend says how to call its two functions and where it runs;
the layout, the device check and the refusals live here."""
from __future__ import annotations

from typing import Callable

import torch

from ._signature import Signature
from .base import check_options

__all__ = ["BSHDKernel"]


class BSHDKernel:
    """A backend over [B, S, h, d] private functions. Subclasses set ``name``, ``missing`` (what to install),
    ``probe`` (the module's cached probe) and implement ``runs_on``, ``call_forward`` and ``call_backward``."""

    name: str
    missing: str
    """The refusal when the functions are absent: what to install."""
    probe: Callable[[], tuple[Signature, Signature] | None]
    supports_mask = False
    supports_softcap = True

    def __init__(self) -> None:
        self._major: dict[int, int] = {}  # per device index: compute capability major, read once

    def runs_on(self, major: int, head_dim: int) -> bool:
        raise NotImplementedError

    def call_forward(self, fwd: Signature, q, k, v, *, causal: bool, scale: float, softcap: float):
        """[B, S, h, d] inputs -> (out [B, S, h, d], lse [B, h, S])."""
        raise NotImplementedError

    def call_backward(self, bwd: Signature, dout, q, k, v, out, lse, *, causal: bool, scale: float, softcap: float):
        """[B, S, h, d] contiguous inputs -> (dq, dk, dv) [B, S, h, d]."""
        raise NotImplementedError

    def supports(self, q: torch.Tensor) -> bool:
        if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16):
            return False
        idx = q.device.index if q.device.index is not None else torch.cuda.current_device()
        if idx not in self._major:
            self._major[idx] = torch.cuda.get_device_capability(idx)[0]
        return self.runs_on(self._major[idx], q.shape[-1]) and type(self).probe() is not None

    def _sigs(self) -> tuple[Signature, Signature]:
        fns = type(self).probe()
        if fns is None:
            raise RuntimeError(f"attention kernel {self.name!r} needs {self.missing}")
        return fns

    def forward(self, q, k, v, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        fwd, _ = self._sigs()
        out, lse = self.call_forward(fwd, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal,
                                     scale=scale, softcap=softcap)
        return out.transpose(1, 2), lse.float().contiguous()  # [B, h, S, d], [B, h, S]

    def backward(self, dout, q, k, v, out, lse, *, causal, scale, mask=None, softcap=0.0):
        check_options(self, mask=mask, softcap=softcap)
        _, bwd = self._sigs()
        qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
        dq, dk, dv = self.call_backward(
            bwd, dout.to(q.dtype).transpose(1, 2).contiguous(), qt, kt, vt, out.to(q.dtype).transpose(1, 2).contiguous(),
            lse.contiguous(), causal=causal, scale=scale, softcap=softcap)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
