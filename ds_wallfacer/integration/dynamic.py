"""Dynamic sequence parallelism at run time: the groups of every size a row may get, built once at start-up, and
the switch that points the model's attention, mixers and loss at one size for one forward.

Sizes are 1, the powers of two dividing P, and P (``comm.dims.dynamic_sizes``); the groups of size p are the
aligned blocks of p consecutive ranks, in the run's layout shape (``comm.dims.sub_dims``). Why the gradients stay
exact, and why every rank runs one forward and backward per round: Note [Dynamic sequence parallelism] in
docs/design/training.md.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch.distributed as dist
from torch import nn

from ..adapters import hf
from ..adapters.mixer_layers import mixer_head_counts, mixer_layers
from ..adapters.mixer_shards import ATTR as MIXER_ATTR
from ..adapters.mixer_shards import MixerShards
from ..attention.ulysses import InnerAttention
from ..comm import CommLayer
from ..comm.dims import dynamic_sizes, sub_dims
from ..config import RunConfig
from ..data.dynamic import DynamicStepLoader
from ..data.loader import ShardSpec
from ..hf_config import text_config
from ..planner.dynamic import RowSizeChooser, row_model
from .packing import PackedBatches
from .parallel import SequenceParallelGroups, attention_for, build_sequence_parallel, check_same_batch, mixer_shards

__all__ = ["DynamicGroups", "GroupOfSize", "build_dynamic_groups", "check_dynamic_run", "dynamic_groups",
           "dynamic_loader"]


@dataclass(eq=False)
class GroupOfSize:
    """This rank's group of one size and what runs on it."""

    size: int
    groups: SequenceParallelGroups
    attention: InnerAttention
    mixing: MixerShards | None
    packing: PackedBatches

    @property
    def spec(self) -> ShardSpec:
        """This rank's shard of a row its group of this size trains."""
        return self.groups.shard_spec


class DynamicGroups:
    """Every size's ``GroupOfSize`` on this rank, and ``use(size)``, which points the model's attention layers,
    mixer layers and the loss module at that size's groups."""

    def __init__(self, by_size: Mapping[int, GroupOfSize], *, model: nn.Module, sp_size: int) -> None:
        self.by_size = dict(sorted(by_size.items()))
        self.sp_size = sp_size
        self._attention = [m for _, m in hf.attention_modules(model)]
        self._mixers = [m for _, m in mixer_layers(model)]
        self.active: int | None = None
        self.on_switch: Callable[[GroupOfSize], None] | None = None
        """Set by the loss module: re-points its group, packing and P."""

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self.by_size)

    def use(self, size: int) -> GroupOfSize:
        """Point the model at this rank's group of ``size`` ranks (a few attribute writes per layer)."""
        if size not in self.by_size:
            raise ValueError(f"group size {size} was not built: this run's sizes are {list(self.by_size)}")
        g = self.by_size[size]
        if size != self.active:
            hf.point_attention(self._attention, g.attention, sp_size=size)
            for m in self._mixers:
                m.__dict__[MIXER_ATTR] = g.mixing
            if self.on_switch is not None:
                self.on_switch(g)
            self.active = size
        return g


def build_dynamic_groups(full: GroupOfSize, *, model: nn.Module, comm: CommLayer, whole_heads: tuple[int, ...],
                         head_groups: tuple[int, ...], timeout: datetime.timedelta) -> DynamicGroups:
    """Build the groups of every size below P (collective: every rank, the same order) beside ``full``, the run's
    own."""
    setup = full.groups.setup
    dims = setup.dims
    by_size = {dims.sp_size: full}
    for size in dynamic_sizes(dims, whole_heads=whole_heads, head_groups=head_groups):
        if size == dims.sp_size:
            continue
        sub = replace(setup, dims=sub_dims(dims, size), notes=(), planner_choice=None)
        groups = build_sequence_parallel(sub, timeout=timeout)
        by_size[size] = GroupOfSize(
            size, groups, attention_for(groups, comm=comm),
            mixer_shards(groups, comm=comm) if full.mixing is not None else None,
            PackedBatches(group=groups.sp_group, comm=comm, spec=groups.shard_spec),
        )
    return DynamicGroups(by_size, model=model, sp_size=dims.sp_size)


def dynamic_groups(run: RunConfig, full: GroupOfSize, *, model: nn.Module, router_aux: bool, comm: CommLayer,
                   timeout: datetime.timedelta) -> DynamicGroups | None:
    """The start-up step of ``wallfacer.dynamic_sequence_parallel`` (None without it): refuse what it cannot run
    (``check_dynamic_run``), then build the groups of every smaller size beside ``full``, the run's own."""
    if run.wallfacer.dynamic_sequence_parallel is None:
        return None
    check_dynamic_run(run, router_aux=router_aux)
    heads, head_groups = mixer_head_counts(model)
    return build_dynamic_groups(full, model=model, comm=comm, whole_heads=heads, head_groups=head_groups,
                                timeout=timeout)


def dynamic_loader(source: Any, dynamic: DynamicGroups, *, run: RunConfig, model: nn.Module, comm: CommLayer,
                   micro_batch: int, shuffle: bool, seed: int, verify: bool, pad_token_id: int,
                   ignore_index: int) -> DynamicStepLoader:
    """``sp.dataloader`` under dynamic sequence parallelism: each step's rows, their group sizes chosen from the
    planner's row model (``RowSizeChooser``); ``verify``: each batch checked the same on the group that trains it."""
    dims = dynamic.by_size[dynamic.sp_size].groups.setup.dims  # the run's own layout
    rows = row_model(text_config(model), run, sizes=dynamic.sizes, dims=dims,
                     layer_checkpointing=bool(getattr(model, "is_activation_checkpointing", False)))
    check = None
    if verify:
        def check(size: int, batch: Mapping[str, Any]) -> None:
            check_same_batch(batch, group=dynamic.by_size[size].groups.sp_group, comm=comm)

    return DynamicStepLoader(
        source, specs={p: g.spec for p, g in dynamic.by_size.items()}, rank=dist.get_rank(),
        world_size=dims.world_size, sp_size=dims.sp_size, micro_batch=micro_batch,
        gradient_accumulation_steps=run.gradient_accumulation_steps,
        choose=RowSizeChooser(rows, world_size=dims.world_size, sp_size=dims.sp_size), seconds=rows.seconds,
        shuffle=shuffle, seed=seed, pad_token_id=pad_token_id, ignore_index=ignore_index, verify=check,
        check_row=rows.check_row,
    )


def check_dynamic_run(run: RunConfig, *, router_aux: bool) -> None:
    """Refuse at start-up what dynamic sequence parallelism cannot run exactly or without a hang."""
    ms = run.wallfacer.mini_sequence
    if run.zero_stage == 3 and ms is not None and (ms.mlp or ms.lm_head):
        raise ValueError(
            "wallfacer.dynamic_sequence_parallel with ZeRO stage 3 and wallfacer.mini_sequence: a rank's number of "
            "mini-sequences follows its row's length, and ZeRO-3 gathers the parameters once per mini-sequence over "
            "all ranks, so ranks holding rows of different lengths would wait on each other forever. Use ZeRO stage "
            "1 or 2 with mini_sequence, or stage 3 without it")
    zero = run.deepspeed.get("zero_optimization") or {}
    if run.zero_stage == 1 and zero.get("overlap_comm", False):
        raise ValueError("wallfacer.dynamic_sequence_parallel with ZeRO stage 1 and zero_optimization.overlap_comm: "
                         "DeepSpeed cannot overlap stage 1's reduction when the rounds of a step vary; set "
                         "overlap_comm to false or use stage 2")
    if run.deepspeed.get("managed_gradient_accumulation") is True:
        raise ValueError("wallfacer.dynamic_sequence_parallel needs DeepSpeed's managed_gradient_accumulation = "
                         "false (each step has as many rounds as its rows need; engine.step() ends it): drop the key")
    if router_aux:
        raise ValueError("wallfacer.dynamic_sequence_parallel with a MoE router aux loss: the router statistics are "
                         "summed over one sequence-parallel group per forward, not over a step of mixed groups; "
                         "train this model without dynamic_sequence_parallel (or with router_aux_loss_coef = 0)")
