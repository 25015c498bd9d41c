"""Sequence-parallel attention: WallFacer multi-ring (C = 1: ring), kernel backends, volume formulas."""
from .kernels import KERNELS, get_kernel
from .volume import AttnShape, wallfacer_bytes
from .wallfacer import WallFacerAttention, wallfacer_attention

__all__ = ["AttnShape", "KERNELS", "WallFacerAttention", "get_kernel", "wallfacer_attention", "wallfacer_bytes"]

# Ulysses and the hybrid (issue 4)
from .hybrid import sequence_parallel_attention  # noqa: E402
from .ulysses import LocalAttention, UlyssesAttention  # noqa: E402
from .volume import ulysses_bytes  # noqa: E402

__all__ += ["LocalAttention", "UlyssesAttention", "sequence_parallel_attention", "ulysses_bytes"]
