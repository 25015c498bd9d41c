"""Sequence sharding (zigzag / contiguous), global position ids and the causal block schedule."""
from .sharding import SCHEMES, block_calls, check_divisible, chunk_ids, position_ids, shard, unshard

__all__ = ["SCHEMES", "block_calls", "check_divisible", "chunk_ids", "position_ids", "shard", "unshard"]
