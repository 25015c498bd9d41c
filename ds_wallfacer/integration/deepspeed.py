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

import contextlib
import datetime
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..adapters import hf
from ..adapters.mixer_layers import attach_mixers, mixer_head_counts, mixer_layers
from ..adapters.positional import scales_by_position
from ..adapters.rope import RopeLength, wrap_rotary
from ..adapters.vision import vision_language
from ..attention.residuals import keep_attention_in_layers
from ..audit.model_audit import RefusedModel, audit_model, audit_sequence, reentrant_checkpointing
from ..audit.self_check import check_length, run_self_check
from ..comm import CommLayer
from ..config import RunConfig, parse_ds_config
from ..data.dynamic import DynamicStepLoader
from ..data.loader import SequenceParallelLoader, prepare_batch
from ..hf_config import text_config
from ..comm.dims import sub_dims
from ..planner.auto import ParallelSetup, PlanInputs, resolve_auto, run_facts
from ..planner.candidate import Workload
from ..planner.cluster import cluster_preset, get_cluster
from ..planner.dynamic import RowModel, choose_sizes, row_candidates
from ..planner.model import get_model
from .ds_runtime import init_distributed, rank_device
from .loss import LocalLoss, SequenceParallelCausalLM, logits_loss, mini_sequence_loss
from .packing import PackedBatches
from .dynamic import build_dynamic_groups, check_dynamic_run
from .parallel import (SequenceParallelGroups, attention_for, build_sequence_parallel, check_same_batch,
                       mixer_shards)

__all__ = ["SequenceParallel", "initialize", "model_heads", "prepare_sequence_parallel", "row_model"]

log = logging.getLogger("ds_wallfacer")


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
    mini_sequence: Any = None
    """``ds_wallfacer.mst.MiniSequenceHandle`` when mini-sequence chunking is on, else None."""
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
    def dynamic(self) -> Any:
        """``integration.dynamic.DynamicGroups`` with ``wallfacer.dynamic_sequence_parallel``, else None."""
        return self.module.dynamic

    def _dynamic_loader(self, source: Any, *, batch_size: int | None, shuffle: bool, seed: int, verify: bool,
                        balance_steps: bool | None) -> DynamicStepLoader:
        if balance_steps:
            raise ValueError("balance_steps=True with wallfacer.dynamic_sequence_parallel: the dynamic schedule "
                             "already lays each step's rows out by their work; drop balance_steps")
        dims, dyn, comm = self.setup.dims, self.dynamic, self.comm
        micro = batch_size or self.config.micro_batch(dp_size=dims.dp_size)
        gas = self.config.gradient_accumulation_steps
        rows = row_model(self.model, self.config, dyn.sizes, dims)
        check = None
        if verify:
            def check(size: int, batch: Mapping[str, Any]) -> None:
                check_same_batch(batch, group=dyn.by_size[size].groups.sp_group, comm=comm)

        return DynamicStepLoader(
            source, specs={p: g.spec for p, g in dyn.by_size.items()}, rank=dist.get_rank(),
            world_size=dims.world_size, sp_size=dims.sp_size, micro_batch=micro, gradient_accumulation_steps=gas,
            choose=lambda lengths, works: choose_sizes(lengths, works, model=rows, world_size=dims.world_size,
                                                        sp_size=dims.sp_size),
            seconds=rows.seconds, shuffle=shuffle, seed=seed, pad_token_id=self.pad_token_id,
            ignore_index=self.ignore_index, verify=check, check_row=rows.check_row,
        )


def row_model(model: nn.Module, run: RunConfig, sizes: tuple[int, ...], dims: Any) -> RowModel:
    """The planner's model of one row on each group size, for dynamic sequence parallelism's choice: the
    ``wallfacer.cluster`` preset's figures (uncalibrated, so every host chooses alike)."""
    cfg = run.wallfacer
    ms = cfg.mini_sequence
    cluster = get_cluster(cluster_preset() if cfg.cluster == "auto" else cfg.cluster).with_world_size(dims.world_size)
    facts = run_facts(run)
    facts["offload_checkpoints"] |= ms is not None and ms.offload_checkpoints
    checkpointing = bool(getattr(model, "is_activation_checkpointing", False)) or (
        ms is not None and ms.activation_checkpointing != "none")
    cands = row_candidates({p: sub_dims(dims, p) for p in sizes}, mini_sequence=ms is not None,
                           checkpointing=checkpointing, keep_attention=ms.keep_attention if ms is not None else True)
    cap = cfg.dynamic_sequence_parallel.max_tokens_per_rank
    return RowModel(model=get_model(text_config(model)), cluster=cluster,
                    workload=Workload(seq_len=2 * dims.sp_size, **facts), candidates=cands,
                    max_tokens_per_rank=None if cap == "auto" else int(cap))


def model_heads(model: nn.Module) -> tuple[int, int]:
    """(query heads, kv heads) from an HF model's (text) config; for a model without attention (a pure state-space
    model), the heads its mixer layers split over the ranks."""
    text = text_config(model)
    if not isinstance(getattr(text, "num_attention_heads", None), int):
        heads = {int(getattr(m, "num_heads", 0)) for _, m in mixer_layers(model)}
        if heads and all(heads):
            h = math.gcd(*heads)
            return h, h
        raise RefusedModel(f"{type(model).__name__}: its (text) config has no num_attention_heads, so its attention "
                           "cannot be split across ranks: not supported yet")
    hq = int(text.num_attention_heads)
    hk = int(getattr(text, "num_key_value_heads", None) or hq)
    return hq, hk


def _plan_inputs(model: nn.Module, run: RunConfig, seq_len: int | None) -> PlanInputs:
    heads, groups = mixer_head_counts(model)
    return PlanInputs(
        model=text_config(model),
        seq_len=seq_len,
        run=run,
        activation_checkpointing=bool(getattr(model, "is_activation_checkpointing", False)),
        reentrant_checkpointing=reentrant_checkpointing(model),
        default_cluster=cluster_preset(),
        whole_heads=heads,
        head_groups=groups,
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
    # 4. DeepSpeed, with no sequence-parallel mpu (loss.py: every ZeRO stage then normalises correctly)
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
    """Everything ``initialize`` does before ``deepspeed.initialize`` (Note [What initialize does, in order]):
    resolve the setup, audit the model, build the groups, attach attention, MsT, the self-check. The model is
    changed in place; the caller hands DeepSpeed ``sp.module`` (our loop) or the model itself (``hf_trainer``)."""
    # 1. parse and resolve: pure and identical on every rank, so a bad config or model fails everywhere at once
    timeout = datetime.timedelta(seconds=run.wallfacer.collective_timeout_s)
    init_distributed(timeout)
    length = seq_len if seq_len is not None else run.wallfacer.seq_len
    audit_sequence(model, seq_len=length, allow_modules=run.wallfacer.allow_modules)  # before sizes are read
    setup = _resolve_setup(model, run, ranks_per_node=ranks_per_node, seq_len=seq_len)
    dims = setup.dims
    ds_dict = run.deepspeed_dict(world_size=dims.world_size, sp_size=dims.sp_size)
    found = audit_model(model, mini_sequence=run.wallfacer.mini_sequence, seq_len=length, kernel=setup.kernel,
                        sequence=False)
    # 2. groups, this rank's attention on every attention layer, global-length RoPE
    device = rank_device()  # current before any group is built (NCCL communicators use it)
    _check_setup_agrees(setup, device)
    groups = build_sequence_parallel(setup, timeout=timeout)
    comm = CommLayer(device=device)  # every collective tensor is checked against it (comm/ops.py)
    attention = attention_for(groups, comm=comm)
    if hf.attention_modules(model):  # a pure state-space model has none: its mixers are all it needs
        hf.attach(model, attention, sp_size=dims.sp_size)
    mixing = mixer_shards(groups, comm=comm)
    mixers = attach_mixers(model, mixing)  # convolutions, delta-nets, Mamba-2 (mixer_layers.py)
    rope = RopeLength()
    wrap_rotary(model, found.rotary, rope)  # length-reading RoPE sees the global length (rope.py)
    # 3. Mini-Sequence chunking and the loss module
    mst_handle, local_loss = _apply_mini_sequence(model, run, ds_dict, local_loss)
    ms = run.wallfacer.mini_sequence
    if ms is None or ms.keep_attention:  # also layer checkpointing the caller turned on (attention/residuals.py)
        keep_attention_in_layers(model)
    packing = PackedBatches(group=groups.sp_group, comm=comm, spec=groups.shard_spec)
    dynamic = None
    if run.wallfacer.dynamic_sequence_parallel is not None:
        check_dynamic_run(run, router_aux=found.router_aux is not None)
        heads, head_groups = mixer_head_counts(model)
        dynamic = build_dynamic_groups(setup, groups, model=model, comm=comm, full_attention=attention,
                                       full_mixing=mixing if mixers else None, full_packing=packing,
                                       whole_heads=heads, head_groups=head_groups, timeout=timeout)
    module = SequenceParallelCausalLM(model, group=groups.sp_group, comm=comm, local_loss=local_loss,
                                      ignore_index=ignore_index, router_aux=found.router_aux,
                                      rope=rope if found.rotary else None, sp_size=dims.sp_size,
                                      packing=packing,
                                      positions=any(scales_by_position(m) for _, m in hf.attention_modules(model)),
                                      mixer_inputs=mixing.inputs if mixers else None, dynamic=dynamic,
                                      vision=vision_language(model))
    if pad_token_id is None:
        pad_token_id = getattr(model.config, "pad_token_id", None) or 0
    # the model as configured, with and without sequence parallelism (self_check.py); on P ranks only: dynamic
    # sequence parallelism's smaller groups run the same layers
    if run.wallfacer.self_check:
        _self_check(module, run, groups, comm, device, pad_token_id=int(pad_token_id),
                    ignore_index=ignore_index)
    return SequenceParallel(
        config=run, setup=setup, groups=groups, comm=comm, attention=attention, module=module, ds_config=ds_dict,
        mini_sequence=mst_handle, pad_token_id=int(pad_token_id), ignore_index=ignore_index,
    )


def _self_check(module: SequenceParallelCausalLM, run: RunConfig, groups: SequenceParallelGroups, comm: CommLayer,
                device: torch.device, *, pad_token_id: int, ignore_index: int) -> None:
    """Run the start-up self-check on the device training will use (DeepSpeed would move a ZeRO-0/1/2 model there
    anyway; ZeRO-3 models stay where they are), then forget its traffic. Rank 0 logs what it measured."""
    lm = module.lm
    if device.type != "cpu" and run.zero_stage < 3 and any(p.device.type == "cpu" for p in lm.parameters()):
        lm.to(device)
    spec = groups.shard_spec

    def shard(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return prepare_batch(batch, spec, pad_token_id=pad_token_id, ignore_index=ignore_index, vision=module.vision)

    tokens = check_length(text_config(lm), sp_size=groups.setup.dims.sp_size, requested=run.wallfacer.self_check_tokens)
    # parameters ZeRO-3 partitioned at construction (zero.Init) are gathered for the check, as a forward would
    partitioned = [p for p in lm.parameters() if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    with gathered:
        report = run_self_check(module, shard=shard, group=groups.sp_group, comm=comm, tokens=tokens)
    comm.reset()
    module.last_aux_loss = None
    if dist.get_rank() == 0:
        log.warning("ds_wallfacer: %s", report.describe())


def _check_setup_agrees(setup: ParallelSetup, device: torch.device) -> None:
    """Every rank chose the same sizes, placement and mode. "auto" plans from this host's measured speeds
    (``planner/calibrate.py``, cached per host), so hosts that measured differently could choose differently:
    refused here, with the fix, before any group is built."""
    if dist.get_world_size() == 1:
        return
    from ..comm.dims import MODES, PLACEMENTS

    d = setup.dims
    sig = torch.tensor([d.sp_size, d.ulysses_degree, d.ring_count, PLACEMENTS.index(d.placement), MODES.index(d.mode)],
                       dtype=torch.int64, device=device)
    every = CommLayer(device=device).all_gather(sig, dist.group.WORLD, kind="check").tolist()
    differ = [r for r, s in enumerate(every) if s != every[0]]
    if differ:
        raise ValueError(
            f"ds_wallfacer: ranks {differ} chose another parallel layout than rank 0 (sequence_parallel_size, "
            f"ulysses_degree, ring_count, placement, mode by rank: {every}). \"auto\" plans from each host's measured "
            f"speeds; set those keys in the \"wallfacer\" section, or give every host the same calibration "
            f"(DS_WALLFACER_CACHE_DIR on shared storage, or DS_WALLFACER_CALIBRATION=off)"
        )


def _resolve_setup(
    model: nn.Module, run: RunConfig, *, ranks_per_node: int | None, seq_len: int | None
) -> ParallelSetup:
    """The validated setup ("auto" by the planner when a length is known); rank 0 logs it and the reasons."""
    hq, hk = model_heads(model)
    setup = resolve_auto(run.wallfacer, world_size=dist.get_world_size(), num_heads=hq, num_kv_heads=hk,
                          ranks_per_node=ranks_per_node, planner_inputs=_plan_inputs(model, run, seq_len))
    if dist.get_rank() == 0:
        log.warning("%s", setup.describe())
    return setup


def _apply_mini_sequence(
    model: nn.Module, run: RunConfig, ds_dict: dict, local_loss: LocalLoss | None
) -> tuple[Any, LocalLoss]:
    """(MsT handle or None, the local loss): the chunked LM head when ``mini_sequence.lm_head`` is on."""
    ms = run.wallfacer.mini_sequence
    handle = None
    if ms is not None:
        from ..mst import apply_mini_sequence

        handle = apply_mini_sequence(model, ms, ds_config=ds_dict)
    if local_loss is None:
        local_loss = mini_sequence_loss if (ms is not None and ms.lm_head) else logits_loss
    return handle, local_loss
