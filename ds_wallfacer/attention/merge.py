"""The log-sum-exp merge of a block's (out, lse) into fp32 accumulators, in place (``merge_``): one Triton kernel on
CUDA, plain PyTorch (``merge_torch_``) elsewhere, with the same semantics.

Design: Note [Log-sum-exp merge] in docs/design/attention.md (why one kernel; rows that see no key).
"""
from __future__ import annotations

import torch

__all__ = ["merge_", "merge_torch_", "triton_merge_available"]

try:  # Triton ships with CUDA builds of torch; CPU builds have none
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - any import failure means "use the PyTorch path"
    triton = None


def triton_merge_available() -> bool:
    return triton is not None and torch.cuda.is_available()


def merge_torch_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The plain-PyTorch merge: any device, any layout (acc_out may be a strided view)."""
    new = torch.logaddexp(acc_lse, lse.float())
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with no key seen yet
    a = torch.exp(acc_lse - safe).unsqueeze(-1)
    b = torch.exp(lse.float() - safe).unsqueeze(-1)
    acc_out.mul_(a).add_(out.float() * b)
    acc_lse.copy_(new)


def _qualifies(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> bool:
    """Whether the Triton kernel takes these tensors: CUDA, fp32 accumulators, [B, h, S, d] with the last dim
    contiguous (the leading three may have any strides: slices of a team-wide accumulator)."""
    if triton is None or not acc_out.is_cuda:
        return False
    if acc_out.dtype != torch.float32 or acc_lse.dtype != torch.float32 or not lse.is_floating_point():
        return False
    if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    if acc_out.dim() != 4 or out.shape != acc_out.shape or acc_lse.shape != acc_out.shape[:3] or lse.shape != acc_lse.shape:
        return False
    if acc_out.stride(-1) != 1 or out.stride(-1) != 1 or acc_out.shape[-1] > 1024 or acc_out.numel() == 0:
        return False
    return all(t.device == acc_out.device for t in (acc_lse, out, lse))


if triton is not None:

    @triton.jit
    def _merge_kernel(
        acc_ptr, acc_lse_ptr, out_ptr, lse_ptr, n_rows, H, S, D,
        sa_b, sa_h, sa_s, sal_b, sal_h, sal_s, so_b, so_h, so_s, sl_b, sl_h, sl_s,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
        rmask = rows < n_rows
        s = rows % S
        h = (rows // S) % H
        b = rows // (S * H)
        acc_l = tl.load(acc_lse_ptr + b * sal_b + h * sal_h + s * sal_s, mask=rmask, other=float("-inf"))
        blk_l = tl.load(lse_ptr + b * sl_b + h * sl_h + s * sl_s, mask=rmask, other=float("-inf")).to(tl.float32)
        m = tl.maximum(acc_l, blk_l)
        none = m == float("-inf")
        m_safe = tl.where(none, 0.0, m)
        new = tl.where(none, float("-inf"), m_safe + tl.log(tl.exp(acc_l - m_safe) + tl.exp(blk_l - m_safe)))
        new_safe = tl.where((new == float("-inf")) | (new == float("inf")), 0.0, new)
        wa = tl.exp(acc_l - new_safe)
        wb = tl.exp(blk_l - new_safe)
        cols = tl.arange(0, BLOCK_D)
        m2 = rmask[:, None] & (cols < D)[None, :]
        a_ptrs = acc_ptr + (b * sa_b + h * sa_h + s * sa_s)[:, None] + cols[None, :]
        o_ptrs = out_ptr + (b * so_b + h * so_h + s * so_s)[:, None] + cols[None, :]
        acc = tl.load(a_ptrs, mask=m2, other=0.0)
        o = tl.load(o_ptrs, mask=m2, other=0.0).to(tl.float32)
        tl.store(a_ptrs, acc * wa[:, None] + o * wb[:, None], mask=m2)
        tl.store(acc_lse_ptr + b * sal_b + h * sal_h + s * sal_s, new, mask=rmask)


def merge_triton_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The fused merge (CUDA, Triton); the tensors must qualify (see ``_qualifies``)."""
    b, h, s, d = acc_out.shape
    block_d = triton.next_power_of_2(d)
    block_r = max(1, 4096 // block_d)
    n_rows = b * h * s
    _merge_kernel[(triton.cdiv(n_rows, block_r),)](
        acc_out, acc_lse, out, lse, n_rows, h, s, d,
        *acc_out.stride()[:3], *acc_lse.stride(), *out.stride()[:3], *lse.stride(),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )


def merge_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (acc_out, acc_lse) <- the log-sum-exp combination with a block's (out, lse).

    acc_out fp32 [B, h, S, d] (a strided view is fine), acc_lse fp32 [B, h, S], out any float dtype, lse fp32.
    Triton on CUDA when the tensors qualify, else plain PyTorch; both compute the same thing."""
    if _qualifies(acc_out, acc_lse, out, lse):
        merge_triton_(acc_out, acc_lse, out, lse)
    else:
        merge_torch_(acc_out, acc_lse, out, lse)
