"""The block-attention kernel contract shared by every backend (``BlockKernel``), and the helpers backends share:
kv-head expansion and its gradient (``expand_kv``, ``reduce_kv_grad``), sliding-window masks (``window_mask``), and
the check that a kernel takes the options it is given (``check_options``).
"""
from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["BlockKernel", "check_options", "expand_kv", "reduce_kv_grad", "window_mask"]


class BlockKernel(Protocol):
    """What every backend implements, in ``[B, h, S, d]`` (the layout of HF attention functions and torch SDPA):

    - q ``[B, hq, Sq, d]``, k and v ``[B, hk, Sk, d]`` with ``hq % hk == 0`` (grouped-query attention: kv heads
      are never expanded before communication; a backend expands locally if its kernel needs it); v (and out, dout)
      may have a head dim dv of its own only in backends with ``supports_value_dim`` (``get_kernel(value_dim=True)``
      wraps the others: ``value_dim.py``)
    - ``forward`` -> (out ``[B, hq, Sq, dv]`` in q's dtype, lse ``[B, hq, Sq]`` float32, contiguous)
    - ``backward(dout, q, k, v, out, lse)`` with the *final* out and lse of the full attention (ring attention
      calls it block by block) -> dq, dk, dv in q's dtype or float32
    - ``causal`` is only asked for with Sq == Sk (a diagonal block, aligned top-left)
    - ``mask`` (optional): a bool tensor broadcastable to ``[B, hq, Sq, Sk]``, True where a query may see a key, on
      top of ``causal`` (sliding windows). A query row that sees no key gets out 0 and lse -inf, and no gradient.
      Only backends with ``supports_mask`` take one (``window_mask`` builds a sliding window's).
    - ``softcap`` (optional, 0 = off): logits are ``softcap * tanh(scale * q.k / softcap)`` before the softmax
      (Gemma-2's ``attn_logit_softcapping``). Only backends with ``supports_softcap`` take one.
    """

    name: str
    supports_mask: bool
    """Takes a ``mask`` (sliding windows)."""
    supports_softcap: bool
    """Takes a ``softcap`` > 0."""

    def supports(self, q: torch.Tensor) -> bool:
        """Whether this backend runs on q's device and dtype."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
        mask: torch.Tensor | None = None, softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
        mask: torch.Tensor | None = None,
        softcap: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[B, hk, S, d] -> [B, hq, S, d] (each kv head serves hq/hk consecutive query heads)."""
    rep = q_heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def reduce_kv_grad(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Adjoint of ``expand_kv``: [B, hq, S, d] -> [B, hk, S, d]."""
    b, hq, s, d = g.shape
    rep = hq // kv_heads
    return g if rep == 1 else g.view(b, kv_heads, rep, s, d).sum(dim=2)


def window_mask(ranges, window: int, device: torch.device) -> torch.Tensor:
    """[Sq, Sk] bool: key j visible from query i iff 0 <= i - j < window, for a kernel call's global index
    ``ranges`` = (query ranges, key ranges) (``blocks.KernelCall.mask``)."""
    gq, gk = ranges
    qi = torch.cat([torch.arange(a, b, device=device) for a, b in gq]).unsqueeze(-1)
    kj = torch.cat([torch.arange(a, b, device=device) for a, b in gk])
    d = qi - kj
    return (d >= 0) & (d < window)


def check_options(kernel: BlockKernel, *, mask: torch.Tensor | None, softcap: float) -> None:
    """Refuse options a backend cannot honour (the start-up audit refuses them earlier, naming the setting)."""
    if mask is not None and not kernel.supports_mask:
        raise ValueError(f"attention kernel {kernel.name!r} cannot apply an attention mask (sliding window)")
    if softcap and not kernel.supports_softcap:
        raise ValueError(f"attention kernel {kernel.name!r} cannot apply attention logit soft-capping")
