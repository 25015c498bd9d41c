"""Process groups of a ``ParallelSetup``, built once on every rank, and this rank's attention and shard spec.

``dist.new_group`` is collective over the world, so every rank creates every group in the same order:
the sequence-parallel groups (loss reduction, batch checks), the Ulysses groups (consecutive ranks) and, through
``comm.build_groups``, the WallFacer groups over the ring ranks.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from ..attention.hybrid import sequence_parallel_attention
from ..attention.ulysses import InnerAttention
from ..comm import CommLayer, WallFacerGroups, build_groups
from ..comm.groups import DEFAULT_TIMEOUT
from ..planner.auto import ParallelSetup
from ..data.loader import ShardSpec
from ..adapters.mixer_shards import MixerInputs, MixerShards

__all__ = ["SequenceParallelGroups", "attention_for", "build_sequence_parallel", "check_same_batch",
           "mixer_shards"]


@dataclass(frozen=True)
class SequenceParallelGroups:
    """This rank's place and process groups."""

    setup: ParallelSetup
    rank: int
    """Global rank."""
    shard_index: int
    """The data shard this rank holds: ``j * U + u`` with ``j`` its WallFacer index (``ParallelDims.shard_index``;
    equal to ``sp_index`` unless the placement permutes the ring ranks)."""
    dp_index: int
    """Data-parallel replica."""
    sp_group: dist.ProcessGroup
    """The P ranks sharing this rank's sequences."""
    ulysses_group: dist.ProcessGroup | None
    """This rank's U consecutive Ulysses ranks (None when U = 1)."""
    wallfacer: WallFacerGroups | None
    """This rank's WallFacer groups over the R ring ranks (None when R = 1)."""

    @property
    def sp_index(self) -> int:
        """Position of this rank in its sequence-parallel group (``ParallelDims.sp_index``)."""
        return self.setup.dims.sp_index(self.rank)

    @property
    def shard_spec(self) -> ShardSpec:
        dims = self.setup.dims
        return ShardSpec(
            index=self.shard_index, sp_size=dims.sp_size, ulysses_degree=dims.ulysses_degree,
            scheme=self.setup.sharding, dp_rank=self.dp_index, dp_size=dims.dp_size,
        )


def _new_groups(
    rank_lists: Sequence[Sequence[int]], me: int, timeout: datetime.timedelta
) -> dist.ProcessGroup | None:
    """Create one group per rank list (every rank, the same order: ``new_group`` is collective over the world);
    return the one holding ``me``."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks=list(ranks), timeout=timeout)
        if me in ranks:
            mine = g
    return mine


def build_sequence_parallel(
    setup: ParallelSetup, *, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> SequenceParallelGroups:
    """Create all groups of ``setup`` (call on every rank, identically) and return this rank's. Which ranks form
    which group is ``setup.dims``'s (``comm.dims.ParallelDims``)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call deepspeed.init_distributed() first")
    me, world = dist.get_rank(), dist.get_world_size()
    dims = setup.dims
    if world != dims.world_size:
        raise ValueError(f"the setup is for {dims.world_size} ranks, but the world has {world}")
    sp_group = _new_groups(dims.all_sp_ranks(), me, timeout)
    ulysses_group = _new_groups(dims.all_ulysses_ranks(), me, timeout) if dims.ulysses_degree > 1 else None
    wallfacer = (build_groups(dims.rank_layouts(setup.ranks_per_node), timeout=timeout)
                 if dims.ring_size > 1 else None)
    assert sp_group is not None
    return SequenceParallelGroups(
        setup=setup, rank=me, shard_index=dims.shard_index(me), dp_index=dims.dp_index(me), sp_group=sp_group,
        ulysses_group=ulysses_group, wallfacer=wallfacer,
    )


def attention_for(groups: SequenceParallelGroups, *, comm: CommLayer) -> InnerAttention:
    """This rank's sequence-parallel attention object (``attn(q, k, v, causal=, scale=)``)."""
    return sequence_parallel_attention(
        ulysses_group=groups.ulysses_group, wallfacer_groups=groups.wallfacer, comm=comm, kernel=groups.setup.kernel,
        sharding=groups.setup.sharding, sp_group=groups.sp_group, ulysses_head_groups=groups.setup.ulysses_head_groups,
    )


def mixer_shards(groups: SequenceParallelGroups, *, comm: CommLayer) -> MixerShards:
    """Where this rank's sequence pieces sit, for the mixer layers other than attention (``mixer_layers.py``)."""
    dims = groups.setup.dims
    ranks = dims.sp_ranks(groups.dp_index)  # group order
    return MixerShards(group=groups.sp_group, comm=comm, peers=tuple(sorted(ranks, key=dims.shard_index)),
                       index=groups.shard_index, sharding=groups.setup.sharding, ulysses_degree=dims.ulysses_degree,
                       group_shards=tuple(dims.shard_index(r) for r in ranks), group_rank=groups.sp_index,
                       inputs=MixerInputs())


def check_same_batch(batch: Mapping[str, Any], *, group: dist.ProcessGroup, comm: CommLayer) -> None:
    """Raise on every rank of ``group`` when its ranks do not hold the same full batch (a data pipeline that
    is not seeded identically would otherwise train on garbage silently)."""
    ids = torch.as_tensor(batch["input_ids"]).long().reshape(-1)
    weights = torch.arange(1, ids.numel() + 1, dtype=torch.int64, device=ids.device) % 1_000_003
    sig = torch.stack([ids.new_tensor(ids.numel()), (ids * weights).sum(), ids.sum()])  # [3] int64, on ids' device
    for key in ("pixel_values", "pixel_values_videos"):  # images: every rank encodes some frames of its own copy
        if batch.get(key) is not None:
            pixels = torch.as_tensor(batch[key]).double().sum().mul(2**16).round().long().to(ids.device)
            sig = torch.cat([sig, pixels.reshape(1)])
    with comm.phase("data"):
        # the batch is host data: the signature moves to the group's device (NCCL rejects CPU tensors)
        rows = comm.all_gather(comm.place(sig), group, kind="check")
    if not bool((rows == rows[0]).all()):
        raise ValueError(
            "the ranks of a sequence-parallel group received different batches (signatures by rank index: "
            f"{rows.tolist()}); every rank of the group must iterate the same data in the same order (same seed, "
            "no per-rank shuffling)"
        )
