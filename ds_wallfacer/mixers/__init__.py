"""Sequence mixers other than attention, computed on sequence shards: ``short_conv`` (causal depthwise
convolutions, as in LFM2 and inside gated delta-net and Mamba blocks)."""
from .short_conv import ChunkRing, halo_bytes, sharded_causal_conv1d

__all__ = ["ChunkRing", "halo_bytes", "sharded_causal_conv1d"]
