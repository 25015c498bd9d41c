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
from typing import Any, Mapping

from torch import nn

from ..adapters.apply import apply_sequence_parallel
from ..audit.model_audit import audit_model, audit_sequence
from ..audit.self_check import start_up_check
from ..comm import CommLayer
from ..config import RunConfig, parse_ds_config
from ..mst.apply import apply_activation_memory
from .ds_runtime import init_distributed, rank_device
from .dynamic import GroupOfSize, dynamic_groups
from .loss import LocalLoss, SequenceParallelCausalLM, local_loss_for
from .packing import PackedBatches
from .parallel import attention_for, build_sequence_parallel, mixer_shards
from .sequence_parallel import SequenceParallel
from .setup import check_setup_agrees, resolve_setup

__all__ = ["initialize", "prepare_sequence_parallel"]


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
    """Everything ``initialize`` does before ``deepspeed.initialize``: the steps of Note [What initialize does, in
    order], in its order, each a function of the package it belongs to (the order is the same on every rank, and so
    is the order of the collectives). The model is changed in place; the caller hands DeepSpeed ``sp.module`` (our
    loop) or the model itself (``hf_trainer``)."""
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
