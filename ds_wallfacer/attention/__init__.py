"""Sequence-parallel attention: WallFacer multi-ring (C = 1: ring), kernel backends, volume formulas."""
from .kernels import KERNELS, get_kernel
from .volume import AttnShape, wallfacer_bytes
from .wallfacer import WallFacerAttention, wallfacer_attention

__all__ = ["AttnShape", "KERNELS", "WallFacerAttention", "get_kernel", "wallfacer_attention", "wallfacer_bytes"]
