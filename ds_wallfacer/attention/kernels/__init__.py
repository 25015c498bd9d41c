"""Block-attention kernel backends behind one registry, chosen by name or automatically."""
from __future__ import annotations

import torch

from ..kernel_names import AUTO_ORDER, KERNEL_NAMES
from .base import BlockKernel
from .cpu_flash import CpuFlashKernel
from .cuda_sdpa import CudaSdpaKernel
from .cudnn import CudnnKernel
from .flash_attn import FlashAttnKernel, flash_attn_available
from .flash_attn3 import FlashAttn3Kernel
from .flash_attn4 import FlashAttn4Kernel
from .reference import ReferenceKernel
from .value_dim import with_value_dim

__all__ = ["BlockKernel", "KERNELS", "get_kernel", "flash_attn_available"]

KERNELS: dict[str, type] = {
    "reference": ReferenceKernel,
    "cpu_flash": CpuFlashKernel,
    "cuda_sdpa": CudaSdpaKernel,
    "flash_attn": FlashAttnKernel,
    "cudnn": CudnnKernel,
    "flash_attn3": FlashAttn3Kernel,
    "flash_attn4": FlashAttn4Kernel,
}
_INSTALL: dict[str, str] = {
    "flash_attn": "is flash-attn installed? pip install 'ds_wallfacer[flash]'",
    "flash_attn3": "it needs a Hopper GPU and FlashAttention-3, built from the flash-attn repository's hopper/",
    "flash_attn4": "it needs an sm90+ GPU and pip install flash-attn-4",
    "cudnn": "it needs fp16/bf16, head dim <= 128 and a torch build whose cuDNN attention runs on this GPU",
}
"""What a refused backend needs, for the error message."""
if tuple(KERNELS) != KERNEL_NAMES or set(AUTO_ORDER) != set(KERNEL_NAMES):
    raise ImportError(f"kernel registry {list(KERNELS)} and kernel_names.py {KERNEL_NAMES} disagree")


def _lacks(k: BlockKernel, *, mask: bool, softcap: bool) -> str | None:
    if softcap and not k.supports_softcap:
        return "attention logit soft-capping"
    if mask and not k.supports_mask:
        return "a sliding-window mask"
    return None


def get_kernel(
    name: str, sample: torch.Tensor | None = None, *, mask: bool = False, softcap: bool = False,
    value_dim: bool = False,
) -> BlockKernel:
    """The kernel called ``name``; ``"auto"`` picks the fastest that supports ``sample``'s device and dtype and
    what the model needs (``mask``: sliding windows; ``softcap``: attention logit soft-capping; ``value_dim``: v
    head dim unlike q/k's, which every backend takes, padded locally where it needs one dim: ``value_dim.py``)."""
    k = _get_kernel(name, sample, mask=mask, softcap=softcap)
    return with_value_dim(k) if value_dim else k


def _get_kernel(name: str, sample: torch.Tensor | None, *, mask: bool, softcap: bool) -> BlockKernel:
    if name == "auto":
        if sample is None:
            raise ValueError("kernel 'auto' needs a sample tensor to choose by device and dtype")
        for n in AUTO_ORDER:
            k = KERNELS[n]()
            if k.supports(sample) and _lacks(k, mask=mask, softcap=softcap) is None:
                return k
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; choose one of {['auto', *KERNELS]}")
    k = KERNELS[name]()
    if sample is not None and not k.supports(sample):
        raise ValueError(
            f"attention kernel {name!r} does not support {sample.dtype} tensors on {sample.device}"
            f" (head dim {sample.shape[-1]})" + (f": {_INSTALL[name]}" if name in _INSTALL else "")
        )
    missing = _lacks(k, mask=mask, softcap=softcap)
    if missing is not None:
        able = [n for n, cls in KERNELS.items() if _lacks(cls(), mask=mask, softcap=softcap) is None]
        raise ValueError(
            f"attention kernel {name!r} cannot apply {missing}, which this model uses: set \"wallfacer\": "
            f"{{\"kernel\": \"auto\"}} or one of {able}"
        )
    return k
