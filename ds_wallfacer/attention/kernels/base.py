"""The block-attention kernel contract shared by every backend.

Shapes (``[B, h, S, d]``, the layout of HF attention functions and of torch SDPA):

- q ``[B, hq, Sq, d]``, k and v ``[B, hk, Sk, d]`` with ``hq % hk == 0`` (grouped-query attention: kv heads
  are never expanded before communication; a backend expands locally if its kernel needs it)
- ``forward`` -> (out ``[B, hq, Sq, d]`` in q's dtype, lse ``[B, hq, Sq]`` float32, contiguous)
- ``backward(dout, q, k, v, out, lse)`` with the *final* out and lse of the full attention (ring attention
  calls it block by block) -> dq, dk, dv in q's dtype or float32
- ``causal`` is only asked for with Sq == Sk (a diagonal block, aligned top-left)
"""
from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["BlockKernel", "expand_kv", "reduce_kv_grad"]


class BlockKernel(Protocol):
    name: str

    def supports(self, q: torch.Tensor) -> bool:
        """Whether this backend runs on q's device and dtype."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
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
