"""The Trainer's data loaders, made sequence-parallel.

The Trainer's own loader is sharded by accelerate over all W ranks, as if each were a data-parallel replica.
Here the same sampler is sharded over the D replicas only (accelerate's ``prepare_data_loader`` with
``num_processes = D``, ``process_index = d``), so the P ranks of a sequence-parallel group draw the same full
batches, and replica d draws what rank d of a D-rank non-parallel Trainer would. The user's collator builds the
full batch; ``ShardingCollator`` then hands this rank its shard (``data.loader.prepare_batch``: labels shifted
before sharding, global or per-document positions, padding to the multiple the layout needs).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils.data import DataLoader

from ..data.loader import ShardSpec, prepare_batch
from ..data.media import VisionAdapter

__all__ = ["ShardingCollator", "replica_dataloader", "replica_prepare"]

_FLATTENING_EXTRAS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""What ``DataCollatorWithFlattening`` may add beside ``position_ids``: the same documents in flash-attn form. The
loader reads the documents from ``position_ids`` and builds what the sequence-parallel kernels need."""


class ShardingCollator:
    """``inner(features)`` -> a full batch -> this rank's shard (``input_ids``, ``position_ids``,
    ``shift_labels``, and ``token_mask`` / ``document_starts`` / ``chunk_assignment`` where they apply)."""

    def __init__(self, inner: Callable[[Sequence[Any]], Mapping[str, Any]], spec: ShardSpec, *,
                 pad_token_id: int, ignore_index: int, vision: VisionAdapter | None = None) -> None:
        self.inner, self.spec, self.pad_token_id, self.ignore_index = inner, spec, pad_token_id, ignore_index
        self.vision = vision
        """The model's vision-language adapter (images and videos in the batch); None for a text model."""

    def __call__(self, features: Sequence[Any]) -> dict[str, torch.Tensor]:
        batch = dict(self.inner(features))
        if "position_ids" in batch:
            for key in _FLATTENING_EXTRAS:
                batch.pop(key, None)
        return prepare_batch(batch, self.spec, pad_token_id=self.pad_token_id, ignore_index=self.ignore_index,
                             vision=self.vision)


def replica_dataloader(
    dataset: Any,
    *,
    collate_fn: Callable[[Sequence[Any]], Any],
    batch_size: int,
    sampler: Any,
    spec: ShardSpec,
    accelerator: Any,
    loader_kwargs: Mapping[str, Any],
) -> DataLoader:
    """A DataLoader over ``dataset`` sharded over the data-parallel replicas of ``spec`` (not over every rank),
    with accelerate's own sharding, seeding and device placement, as the Trainer's loader has them."""
    params = dict(loader_kwargs)
    if sampler is not None:
        params["sampler"] = sampler
    loader = DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, **params)
    return replica_prepare(loader, dp_size=spec.dp_size, dp_rank=spec.dp_rank, accelerator=accelerator)


def replica_prepare(loader: DataLoader, *, dp_size: int, dp_rank: int, accelerator: Any) -> DataLoader:
    """``accelerator.prepare(loader)`` with the D replicas as the processes: replica ``dp_rank`` draws what process
    ``dp_rank`` of a D-process run draws, every rank of its group the same."""
    from accelerate.data_loader import prepare_data_loader

    return prepare_data_loader(
        loader,
        accelerator.device,
        num_processes=dp_size,
        process_index=dp_rank,
        split_batches=False,
        put_on_device=accelerator.device_placement,
        rng_types=list(accelerator.rng_types),
        dispatch_batches=False,
        even_batches=accelerator.even_batches,
        use_seedable_sampler=accelerator.use_seedable_sampler,
        data_seed=accelerator.dataloader_config.data_seed,
        non_blocking=accelerator.non_blocking,
        use_stateful_dataloader=accelerator.use_stateful_dataloader,
    )
