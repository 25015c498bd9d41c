"""Block-attention kernel backends behind one registry, chosen by name or automatically."""
from __future__ import annotations

import torch

from ..kernel_names import AUTO_ORDER, KERNEL_NAMES
from .base import BlockKernel
from .cpu_flash import CpuFlashKernel
from .cuda_sdpa import CudaSdpaKernel
from .flash_attn import FlashAttnKernel, flash_attn_available
from .reference import ReferenceKernel

__all__ = ["BlockKernel", "KERNELS", "get_kernel", "flash_attn_available"]

KERNELS: dict[str, type] = {
    "reference": ReferenceKernel,
    "cpu_flash": CpuFlashKernel,
    "cuda_sdpa": CudaSdpaKernel,
    "flash_attn": FlashAttnKernel,
}
if tuple(KERNELS) != KERNEL_NAMES or set(AUTO_ORDER) != set(KERNEL_NAMES):
    raise ImportError(f"kernel registry {list(KERNELS)} and kernel_names.py {KERNEL_NAMES} disagree")


def get_kernel(name: str, sample: torch.Tensor | None = None) -> BlockKernel:
    """The kernel called ``name``; ``"auto"`` picks the fastest that supports ``sample``'s device and dtype."""
    if name == "auto":
        if sample is None:
            raise ValueError("kernel 'auto' needs a sample tensor to choose by device and dtype")
        for n in AUTO_ORDER:
            k = KERNELS[n]()
            if k.supports(sample):
                return k
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {['auto', *KERNELS]}")
    k = KERNELS[name]()
    if sample is not None and not k.supports(sample):
        raise ValueError(
            f"attention kernel {name!r} does not support {sample.dtype} tensors on {sample.device}"
            + ("" if name != "flash_attn" else " (is flash-attn installed? pip install 'ds_wallfacer[flash]')")
        )
    return k
