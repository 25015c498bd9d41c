"""Sequence mixers other than attention, computed on sequence shards: ``short_conv`` (causal depthwise
convolutions with a halo from the previous piece, as in LFM2) and ``head_parallel`` (the whole sequence of some
heads on each rank, for recurrent scans such as gated delta-nets)."""
from .head_parallel import gather_heads, head_parallel_bytes, scatter_heads
from .short_conv import ChunkRing, halo_bytes, sharded_causal_conv1d

__all__ = ["ChunkRing", "gather_heads", "halo_bytes", "head_parallel_bytes", "scatter_heads", "sharded_causal_conv1d"]
