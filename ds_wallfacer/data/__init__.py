"""Sequence sharding (zigzag / contiguous), global position ids and the causal block schedule."""
from .sharding import SCHEMES, block_calls, check_divisible, chunk_ids, position_ids, shard, unshard

__all__ = ["SCHEMES", "block_calls", "check_divisible", "chunk_ids", "position_ids", "shard", "unshard"]

# the sequence-parallel data loader (issue 4)
from .loader import (  # noqa: E402
    SequenceParallelLoader,
    ShardSpec,
    collate_right_padded,
    prepare_batch,
    sequence_chunk_ids,
    sequence_position_ids,
    shard_sequence,
    unshard_sequence,
)

__all__ += [
    "SequenceParallelLoader",
    "ShardSpec",
    "collate_right_padded",
    "prepare_batch",
    "sequence_chunk_ids",
    "sequence_position_ids",
    "shard_sequence",
    "unshard_sequence",
]
