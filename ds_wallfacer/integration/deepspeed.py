"""The one entry point around ``deepspeed.initialize``.

    engine, sp = initialize(model=hf_causal_lm, config="ds_configs/hybrid.json", optimizer=...)
    for batch in sp.dataloader(dataset):
        loss = engine(**batch)          # global token-mean loss, the number a non-parallel run prints
        engine.backward(loss)
        engine.step()

Design: Note [What initialize does, in order] in docs/design/audit.md; DeepSpeed gets no sequence-parallel mpu:
Note [Gradient normalisation across ZeRO stages] (docs/design/layouts.md).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
from torch import nn

from ..adapters.hf import apply_sequence_parallel
from ..audit.model_audit import audit_model, audit_sequence
from ..audit.self_check import start_up_check
from ..comm import CommLayer
from ..config import RunConfig, parse_ds_config
from ..data.dynamic import DynamicStepLoader
from ..data.loader import SequenceParallelLoader, prepare_batch
from ..mst.apply import MiniSequenceHandle, apply_activation_memory
from ..planner.auto import ParallelSetup
from .ds_runtime import init_distributed, rank_device
from .dynamic import DynamicGroups, GroupOfSize, dynamic_groups, dynamic_loader
from .loss import LocalLoss, SequenceParallelCausalLM, local_loss_for
from .packing import PackedBatches
from .parallel import SequenceParallelGroups, attention_for, build_sequence_parallel, check_same_batch, mixer_shards
from .setup import check_setup_agrees, resolve_setup

__all__ = ["SequenceParallel", "initialize", "prepare_sequence_parallel"]


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
    attention: Any
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
    ) -> Any:
        """Wrap a map-style dataset or an iterable of full batches (see ``SequenceParallelLoader``); with
        ``wallfacer.dynamic_sequence_parallel``, a map-style dataset's optimizer steps (``DynamicStepLoader``: iterate
        each step's batches, then call ``engine.step()`` once).
        ``batch_size`` defaults to ``train_micro_batch_size_per_gpu``; ``verify`` checks each batch is the same
        on all ranks of the sequence-parallel group (one tiny all-gather per batch); ``balance_steps`` (default:
        the section's ``balance_steps``) evens the replicas' attention work in each round (a map-style dataset;
        ``data/steps.py``); ``dynamic=False``: batches over all P ranks even with dynamic sequence parallelism (an
        evaluation)."""
        if self.dynamic is not None and dynamic:
            return self._dynamic_loader(source, batch_size=batch_size, shuffle=shuffle, seed=seed, verify=verify,
                                        balance_steps=balance_steps)
        spec = self.groups.shard_spec
        bs = batch_size or self.config.micro_batch(dp_size=self.setup.dims.dp_size)
        check = None
        if verify and self.setup.dims.sp_size > 1:
            group, comm = self.groups.sp_group, self.comm

            def check(batch: Mapping[str, Any]) -> None:
                check_same_batch(batch, group=group, comm=comm)

        return SequenceParallelLoader(
            source, spec, batch_size=bs, shuffle=shuffle, seed=seed, drop_last=drop_last,
            pad_token_id=self.pad_token_id, ignore_index=self.ignore_index, pad=pad, verify=check,
            balance_steps=self.config.wallfacer.balance_steps if balance_steps is None else balance_steps,
            vision=self.module.vision,
        )

    @property
    def dynamic(self) -> DynamicGroups | None:
        """The groups of every size with ``wallfacer.dynamic_sequence_parallel``, else None."""
        return self.module.dynamic

    def _dynamic_loader(self, source: Any, *, batch_size: int | None, shuffle: bool, seed: int, verify: bool,
                        balance_steps: bool | None) -> DynamicStepLoader:
        if balance_steps:
            raise ValueError("balance_steps=True with wallfacer.dynamic_sequence_parallel: the dynamic schedule "
                             "already lays each step's rows out by their work; drop balance_steps")
        return dynamic_loader(
            source, self.dynamic, run=self.config, model=self.model, comm=self.comm,
            micro_batch=batch_size or self.config.micro_batch(dp_size=self.setup.dims.dp_size), shuffle=shuffle,
            seed=seed, verify=verify, pad_token_id=self.pad_token_id, ignore_index=self.ignore_index,
        )


def initialize(
    *,
    model: nn.Module,
    config: str | Mapping[str, Any],
    optimizer: Any = None,
    model_parameters: Any = None,
    lr_scheduler: Any = None,
    local_loss: LocalLoss | None = None,
    pad_token_id: int | None = None,
    ignore_index: int = -100,
    ranks_per_node: int | None = None,
    seq_len: int | None = None,
    **deepspeed_kwargs: Any,
) -> tuple[Any, SequenceParallel]:
    """Set up sequence parallelism for an HF causal LM and call ``deepspeed.initialize``.

    ``config``: a ds_config path or dict with a ``"wallfacer"`` section. ``optimizer`` / ``model_parameters`` /
    ``lr_scheduler`` are passed to DeepSpeed (a client optimizer must be built over ``model.parameters()``).
    ``local_loss``: (loss_sum, count) on this rank's shard; default: the Mini-Sequence LM head when
    ``mini_sequence.lm_head`` is on, else the model's logits. Returns (engine, ``SequenceParallel``); the engine's
    forward takes a loader batch and returns the global token-mean loss. ``seq_len``: tokens per training
    sequence, for the planner that resolves "auto" values (``wallfacer.seq_len`` in the config does the same);
    without either, "auto" falls back to the safe rule. Rank 0 logs the setup and the planner's reasons.
    """
    import deepspeed

    run = parse_ds_config(config)
    sp = prepare_sequence_parallel(model, run, local_loss=local_loss, pad_token_id=pad_token_id,
                                   ignore_index=ignore_index, ranks_per_node=ranks_per_node, seq_len=seq_len)
    # then DeepSpeed, with no sequence-parallel mpu (loss.py: every ZeRO stage then normalises correctly)
    module = sp.module
    if optimizer is None and model_parameters is None:
        model_parameters = [p for p in module.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
        config=sp.ds_config, **deepspeed_kwargs,
    )
    return engine, sp


def prepare_sequence_parallel(
    model: nn.Module,
    run: RunConfig,
    *,
    local_loss: LocalLoss | None = None,
    pad_token_id: int | None = None,
    ignore_index: int = -100,
    ranks_per_node: int | None = None,
    seq_len: int | None = None,
) -> SequenceParallel:
    """Everything ``initialize`` does before ``deepspeed.initialize``, one named step per line in the order of
    Note [What initialize does, in order]; each step lives in the package it belongs to. The model is changed in
    place; the caller hands DeepSpeed ``sp.module`` (our loop) or the model itself (``hf_trainer``)."""
    timeout = datetime.timedelta(seconds=run.wallfacer.collective_timeout_s)
    init_distributed(timeout)
    # pure and identical on every rank, so a bad config or model fails everywhere at once, before any collective
    length = seq_len if seq_len is not None else run.wallfacer.seq_len
    audit_sequence(model, seq_len=length, allow_modules=run.wallfacer.allow_modules)  # before sizes are read
    setup = resolve_setup(model, run, ranks_per_node=ranks_per_node, seq_len=seq_len)
    dims = setup.dims
    ds_dict = run.deepspeed_dict(world_size=dims.world_size, sp_size=dims.sp_size)
    found = audit_model(model, mini_sequence=run.wallfacer.mini_sequence, seq_len=length, kernel=setup.kernel,
                        sequence=False)
    device = rank_device()  # current before any group is built (NCCL communicators use it)
    check_setup_agrees(setup, device)
    groups = build_sequence_parallel(setup, timeout=timeout)
    comm = CommLayer(device=device)  # every collective tensor is checked against it (comm/ops.py)
    attention = attention_for(groups, comm=comm)
    adapted = apply_sequence_parallel(model, attention=attention, mixing=mixer_shards(groups, comm=comm),
                                      rotary=found.rotary, sp_size=dims.sp_size)
    mst_handle = apply_activation_memory(model, run.wallfacer.mini_sequence, ds_config=ds_dict)
    packing = PackedBatches(group=groups.sp_group, comm=comm, spec=groups.shard_spec)
    dynamic = dynamic_groups(run, GroupOfSize(dims.sp_size, groups, attention, adapted.mixing, packing), model=model,
                             router_aux=found.router_aux is not None, comm=comm, timeout=timeout)
    module = SequenceParallelCausalLM(
        model, group=groups.sp_group, comm=comm, ignore_index=ignore_index, sp_size=dims.sp_size, packing=packing,
        local_loss=local_loss_for(run.wallfacer.mini_sequence, given=local_loss), router_aux=found.router_aux,
        rope=adapted.rope, positions=adapted.positions, vision=adapted.vision, dynamic=dynamic,
        mixer_inputs=adapted.mixing.inputs if adapted.mixing is not None else None)
    pad = int(pad_token_id if pad_token_id is not None else getattr(model.config, "pad_token_id", None) or 0)
    # the model as configured, with and without sequence parallelism; on P ranks only: dynamic sequence
    # parallelism's smaller groups run the same layers
    if run.wallfacer.self_check:
        start_up_check(module, spec=groups.shard_spec, group=groups.sp_group, comm=comm, device=device,
                       zero_stage=run.zero_stage, tokens=run.wallfacer.self_check_tokens, pad_token_id=pad,
                       ignore_index=ignore_index)
    return SequenceParallel(config=run, setup=setup, groups=groups, comm=comm, attention=attention, module=module,
                            ds_config=ds_dict, mini_sequence=mst_handle, pad_token_id=pad, ignore_index=ignore_index)
