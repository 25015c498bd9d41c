"""The block-kernel backend names (pure: the config validates ``wallfacer.kernel`` against them without torch).

The registry in ``kernels/__init__.py`` maps each name to its class and checks it covers exactly these names.
"""
__all__ = ["AUTO_ORDER", "KERNEL_NAMES"]

KERNEL_NAMES: tuple[str, ...] = (
    "reference", "cpu_flash", "cuda_sdpa", "flash_attn", "cudnn", "flash_attn3", "flash_attn4",
)
"""Every backend, by the name ``wallfacer.kernel`` takes ("auto" picks among them)."""
AUTO_ORDER: tuple[str, ...] = (
    "flash_attn3", "flash_attn4", "cudnn", "flash_attn", "cuda_sdpa", "cpu_flash", "reference",
)
"""What "auto" tries, fastest first: the first that supports the tensors' device, dtype and head dim and what
the model needs (masks, soft-capping). Each backend's ``supports`` decides per device: FlashAttention-3 runs on
Hopper only and comes first there (Hopper-tuned); flash-attn-4 serves Blackwell, and Hopper where
FlashAttention-3 is not installed; then cuDNN (PyTorch 2.5's release notes report it up to 75% faster than
flash-attn 2 on H100), flash-attn 2, PyTorch's CUDA kernels, the CPU kernels. The order among the first three is
not measured here: ``benchmarks/gpu_check.sh`` prints each one's TFLOP/s side by side."""
