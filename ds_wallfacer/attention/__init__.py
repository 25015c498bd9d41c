"""Sequence-parallel attention: WallFacer multi-ring (C = 1: ring), DeepSpeed-Ulysses all-to-all, the
hybrid of both, the block-kernel backends, and the exact byte formulas of each."""
from .hybrid import sequence_parallel_attention
from .kernels import KERNELS, get_kernel
from .ulysses import LocalAttention, UlyssesAttention
from .volume import AttnShape, ulysses_bytes, wallfacer_bytes
from .wallfacer import WallFacerAttention, wallfacer_attention

__all__ = [
    "AttnShape",
    "KERNELS",
    "LocalAttention",
    "UlyssesAttention",
    "WallFacerAttention",
    "get_kernel",
    "sequence_parallel_attention",
    "ulysses_bytes",
    "wallfacer_attention",
    "wallfacer_bytes",
]
