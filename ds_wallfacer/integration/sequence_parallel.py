"""What the training loop holds beside the engine (``SequenceParallel``, returned by ``initialize`` and
``prepare_sequence_parallel``): the resolved setup, this rank's groups and comm layer, the loss module DeepSpeed
wraps, and the data loaders that shard full batches for this rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from ..attention.ulysses import InnerAttention
from ..comm import CommLayer
from ..config import RunConfig
from ..data.dynamic import DynamicStepLoader
from ..data.loader import SequenceParallelLoader, prepare_batch
from ..mst.apply import MiniSequenceHandle
from ..planner.auto import ParallelSetup
from .dynamic import DynamicGroups, dynamic_loader
from .loss import SequenceParallelCausalLM
from .parallel import SequenceParallelGroups, check_same_batch

__all__ = ["SequenceParallel"]


@dataclass(eq=False)
class SequenceParallel:
    """What the training loop needs beside the engine: the setup, groups, the data loader and the loss wrapper."""

    config: RunConfig
    """The parsed ds_config."""
    setup: ParallelSetup
    """The resolved setup: ``setup.dims`` holds the sizes; what "auto" chose is in ``setup.notes``."""
    groups: SequenceParallelGroups
    """This rank's process groups."""
    comm: CommLayer
    """The counted comm layer used by attention and loss (``comm.by_kind("forward")`` etc.)."""
    attention: InnerAttention
    """This rank's sequence-parallel attention object (attached to every attention layer)."""
    module: SequenceParallelCausalLM
    """The module DeepSpeed wraps: ``module.lm`` is the HF model."""
    ds_config: dict = field(default_factory=dict)
    """The dict handed to ``deepspeed.initialize``: the ds_config without the ``"wallfacer"`` section, with the
    batch sizes for this world and sequence-parallel size (built once, in ``prepare_sequence_parallel``)."""
    mini_sequence: MiniSequenceHandle | None = None
    """The MsT handle when mini-sequence chunking is on, else None."""
    pad_token_id: int = 0
    ignore_index: int = -100

    @property
    def model(self) -> nn.Module:
        """The HF model (parameters as DeepSpeed holds them)."""
        return self.module.lm

    @property
    def aux_loss(self) -> torch.Tensor | None:
        """The last forward's MoE router aux loss over the whole sequence (detached, before
        ``router_aux_loss_coef``; the engine's loss includes ``coef * aux_loss``), for logging; None without one."""
        return self.module.last_aux_loss

    def shard(self, batch: Mapping[str, Any], *, pad: bool = True) -> dict[str, torch.Tensor]:
        """One full batch -> this rank's ``input_ids``, ``position_ids``, ``shift_labels``."""
        return prepare_batch(
            batch, self.groups.shard_spec, pad_token_id=self.pad_token_id, ignore_index=self.ignore_index, pad=pad,
            vision=self.module.vision,
        )

    def dataloader(
        self,
        source: Any,
        *,
        batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
        pad: bool = True,
        verify: bool = True,
        balance_steps: bool | None = None,
        dynamic: bool = True,
    ) -> SequenceParallelLoader | DynamicStepLoader:
        """Wrap a map-style dataset or an iterable of full batches (see ``SequenceParallelLoader``); with
        ``wallfacer.dynamic_sequence_parallel``, a map-style dataset's optimizer steps (``DynamicStepLoader``: iterate
        each step's batches, then call ``engine.step()`` once).
        ``batch_size`` defaults to ``train_micro_batch_size_per_gpu``; ``verify`` checks each batch is the same
        on all ranks of the sequence-parallel group (one tiny all-gather per batch); ``balance_steps`` (default:
        the section's ``balance_steps``) evens the replicas' attention work in each round (a map-style dataset;
        ``data/steps.py``); ``dynamic=False``: batches over all P ranks even with dynamic sequence parallelism (an
        evaluation)."""
        bs = batch_size or self.config.micro_batch(dp_size=self.setup.dims.dp_size)
        if self.dynamic is not None and dynamic:
            if balance_steps:
                raise ValueError("balance_steps=True with wallfacer.dynamic_sequence_parallel: the dynamic schedule "
                                 "already lays each step's rows out by their work; drop balance_steps")
            return dynamic_loader(source, self.dynamic, run=self.config, model=self.model, comm=self.comm,
                                  micro_batch=bs, shuffle=shuffle, seed=seed, verify=verify,
                                  pad_token_id=self.pad_token_id, ignore_index=self.ignore_index)
        check = None
        if verify and self.setup.dims.sp_size > 1:
            group, comm = self.groups.sp_group, self.comm

            def check(batch: Mapping[str, Any]) -> None:
                check_same_batch(batch, group=group, comm=comm)

        return SequenceParallelLoader(
            source, self.groups.shard_spec, batch_size=bs, shuffle=shuffle, seed=seed, drop_last=drop_last,
            pad_token_id=self.pad_token_id, ignore_index=self.ignore_index, pad=pad, verify=check,
            balance_steps=self.config.wallfacer.balance_steps if balance_steps is None else balance_steps,
            vision=self.module.vision,
        )

    @property
    def dynamic(self) -> DynamicGroups | None:
        """The groups of every size with ``wallfacer.dynamic_sequence_parallel``, else None."""
        return self.module.dynamic
