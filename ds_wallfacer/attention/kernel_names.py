"""The block-kernel backend names (pure: the config validates ``wallfacer.kernel`` against them without torch).

The registry in ``kernels/__init__.py`` maps each name to its class and checks it covers exactly these names.
"""
__all__ = ["AUTO_ORDER", "KERNEL_NAMES"]

KERNEL_NAMES: tuple[str, ...] = ("reference", "cpu_flash", "cuda_sdpa", "flash_attn")
"""Every backend, by the name ``wallfacer.kernel`` takes ("auto" picks among them)."""
AUTO_ORDER: tuple[str, ...] = ("flash_attn", "cuda_sdpa", "cpu_flash", "reference")
"""What "auto" tries, fastest first: the first that supports the tensors' device and dtype."""
