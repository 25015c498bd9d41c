"""Sequence sharding (zigzag / contiguous), global position ids, the causal block schedule, and the
sequence-parallel data loader (labels shifted before sharding)."""
from .._lazy import lazy_exports

_EXPORTS = {
    "SequenceParallelLoader": ".loader",
    "ShardSpec": ".loader",
    "collate_right_padded": ".loader",
    "prepare_batch": ".loader",
    "sequence_chunk_ids": ".loader",
    "sequence_position_ids": ".loader",
    "shard_sequence": ".loader",
    "unshard_sequence": ".loader",
    "SCHEMES": ".chunks",
    "SHARDINGS": ".chunks",
    "block_calls": "..attention.schedule",
    "check_divisible": ".chunks",
    "chunk_ids": ".chunks",
    "position_ids": ".sharding",
    "shard": ".sharding",
    "unshard": ".sharding",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
