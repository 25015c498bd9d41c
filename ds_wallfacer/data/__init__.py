"""Sequence sharding (zigzag / contiguous), global position ids, the causal block schedule, and the
sequence-parallel data loader (labels shifted before sharding)."""
from .loader import (
    SequenceParallelLoader,
    ShardSpec,
    collate_right_padded,
    prepare_batch,
    sequence_chunk_ids,
    sequence_position_ids,
    shard_sequence,
    unshard_sequence,
)
from .sharding import SCHEMES, block_calls, check_divisible, chunk_ids, position_ids, shard, unshard

__all__ = [
    "SCHEMES",
    "SequenceParallelLoader",
    "ShardSpec",
    "block_calls",
    "check_divisible",
    "chunk_ids",
    "collate_right_padded",
    "position_ids",
    "prepare_batch",
    "sequence_chunk_ids",
    "sequence_position_ids",
    "shard",
    "shard_sequence",
    "unshard",
    "unshard_sequence",
]
