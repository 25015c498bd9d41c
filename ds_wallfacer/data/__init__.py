"""Sequence sharding (zigzag / contiguous / balanced), global position ids, the
sequence-parallel data loader (labels shifted before sharding), packed documents and their attention work, and
rounds of micro-batches with even work over the data-parallel replicas."""
from .._lazy import lazy_exports

_EXPORTS = {
    "BalancedStepSampler": ".loader",
    "SequenceParallelLoader": ".loader",
    "item_work": ".loader",
    "balanced_order": ".steps",
    "idle_share": ".steps",
    "round_balance": ".steps",
    "row_work": ".steps",
    "ShardSpec": ".loader",
    "collate_right_padded": ".loader",
    "prepare_batch": ".loader",
    "sequence_chunk_ids": ".pieces",
    "sequence_position_ids": ".pieces",
    "shard_sequence": ".pieces",
    "unshard_sequence": ".pieces",
    "check_sequence_length": ".pieces",
    "DEFAULT_CHUNKS_PER_RANK": ".chunks",
    "balance_ratio": ".balance",
    "balanced_assignment": ".balance",
    "balanced_assignment_from_work": ".balance",
    "check_assignment": ".balance",
    "chunk_work": ".balance",
    "rank_work": ".balance",
    "segment_work": ".balance",
    "zigzag_assignment": ".balance",
    "document_ids": ".packing",
    "document_lengths_from_position_ids": ".packing",
    "document_positions": ".packing",
    "document_starts": ".packing",
    "starts_of": ".packing",
    "mask_document_ends": ".packing",
    "normalize_document_lengths": ".packing",
    "SHARDINGS": ".chunks",
    "check_divisible": ".chunks",
    "chunk_ids": ".chunks",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
