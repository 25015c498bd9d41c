"""Sequence-parallel attention: WallFacer multi-ring (C = 1: ring), DeepSpeed-Ulysses all-to-all, the
hybrid of both, the block-kernel backends, the exact byte formulas of each, and the results attention keeps for a
checkpointed layer's recompute (``residuals``)."""
from .._lazy import lazy_exports

_EXPORTS = {
    "sequence_parallel_attention": ".hybrid",
    "KERNELS": ".kernels",
    "get_kernel": ".kernels",
    "LocalAttention": ".local",
    "UlyssesAttention": ".ulysses",
    "KeepAttention": ".residuals",
    "kept_bytes_per_layer": ".residuals",
    "residual_stats": ".residuals",
    "AttnShape": ".volume",
    "ulysses_bytes": ".volume",
    "wallfacer_bytes": ".volume",
    "WallFacerAttention": ".wallfacer",
    "wallfacer_attention": ".wallfacer",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
