"""What the Trainer path reads from a transformers ``Trainer``: the ``"wallfacer"`` section of the ds_config it
was given (taken out before accelerate and DeepSpeed build the engine), and the Trainer options it refuses.

Every refusal names the option and what to do; they are raised on every rank, at construction, before any
process group exists (the checks read only arguments, identical on every rank).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

from ..config import RunConfig, parse_ds_config
from ..config.alst import apply_alst_keys

__all__ = ["UnsupportedTrainerOption", "refuse_accelerate_sp", "refuse_common_options", "refuse_unbalanceable",
           "refuse_unsupported", "refuse_unsupported_model", "take_wallfacer_section"]

_SECTION = "wallfacer"
_KEPT = "_wallfacer_section"  # where a taken section stays, for a second Trainer built from the same arguments


class UnsupportedTrainerOption(ValueError):
    """A Trainer option the sequence-parallel path cannot compute exactly (yet)."""


def _config_dicts(args: Any, accelerator: Any) -> list[dict]:
    """Every distinct dict that holds the DeepSpeed config the Trainer will build its engine from."""
    found: list[dict] = []
    hf_cfg = getattr(args, "hf_deepspeed_config", None)
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    for holder, attr in ((hf_cfg, "config"), (getattr(plugin, "hf_ds_config", None), "config"),
                         (plugin, "deepspeed_config")):
        d = getattr(holder, attr, None) if holder is not None else None
        if isinstance(d, dict) and all(d is not x for x in found):
            found.append(d)
    return found


def take_wallfacer_section(args: Any, accelerator: Any) -> RunConfig:
    """Parse the ``"wallfacer"`` section of the Trainer's ds_config and remove it from the dicts DeepSpeed gets
    (DeepSpeed reads only its own keys; ours is parsed once, here). Batch sizes stay the Trainer's: it fills the
    ``"auto"`` ones from ``TrainingArguments`` and checks the others against them."""
    if not getattr(args, "deepspeed", None):
        raise UnsupportedTrainerOption(
            "WallfacerTrainer runs through DeepSpeed: pass TrainingArguments(deepspeed=<ds_config path or dict>) "
            'whose ds_config has a "wallfacer" section'
        )
    dicts = _config_dicts(args, accelerator)
    if not dicts:
        raise UnsupportedTrainerOption("TrainingArguments(deepspeed=...) was given, but the Trainer holds no "
                                       "DeepSpeed config: construct the TrainingArguments after importing DeepSpeed")
    hf_cfg = getattr(args, "hf_deepspeed_config", None)
    for d in dicts:  # DeepSpeed's own sequence-parallel keys: read with its meaning, kept from its engine
        apply_alst_keys(d)
    section = next((d[_SECTION] for d in dicts if _SECTION in d), None)
    if section is None:
        section = getattr(hf_cfg, _KEPT, None)
    if section is None:
        raise UnsupportedTrainerOption('the ds_config has no "wallfacer" section (nor DeepSpeed\'s '
                                       'sequence_parallel_size): add one (docs/config.md), e.g. '
                                       '"wallfacer": {"sequence_parallel_size": "auto", "mode": "wallfacer"}')
    for d in dicts:
        d.pop(_SECTION, None)
    if hf_cfg is not None:
        setattr(hf_cfg, _KEPT, section)
    raw = copy.deepcopy(dicts[0])
    raw[_SECTION] = copy.deepcopy(section)
    run = parse_ds_config(raw)
    # the Trainer's batch arithmetic counts every rank as data-parallel (as DeepSpeed must, docs/design/layouts.md): the
    # sequence-level total of our own loop does not apply here
    return dataclasses.replace(run, train_batch_size=None)


def refuse_accelerate_sp(pc: Any) -> None:
    """accelerate's ``ParallelismConfig`` with sequence parallelism (``sp_size`` > 1) drives DeepSpeed's own Ulysses
    (its attention, loader and loss): refused with the one-line way to ours."""
    if pc is not None and (getattr(pc, "sp_size", 1) or 1) > 1:
        raise UnsupportedTrainerOption(
            f"accelerate's ParallelismConfig(sp_backend={getattr(pc, 'sp_backend', None)!r}, sp_size={pc.sp_size}) "
            "runs accelerate's own sequence parallelism: drop parallelism_config and put "
            f'"sequence_parallel_size": {pc.sp_size} in the ds_config (DeepSpeed\'s key, or the "wallfacer" section)'
        )


_KNOWN_LOSSES = frozenset({"transformers.trainer.Trainer", "trl.trainer.sft_trainer.SFTTrainer",
                           "ds_wallfacer.hf_trainer.trainer.WallfacerTrainerMixin"})
"""The mixin's ``compute_loss`` and those it replaces exactly (the token-mean NLL of the causal LM)."""


def refuse_foreign_loss(trainer: Any) -> None:
    """A trainer class whose own ``compute_loss`` is not the token-mean NLL (DPO, GRPO, a user's loss) would have
    it replaced by the mixin's, or run it on shards: refused, naming the class."""
    for cls in type(trainer).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        if "compute_loss" in vars(cls) and name not in _KNOWN_LOSSES:
            raise UnsupportedTrainerOption(
                f"{cls.__name__} defines its own compute_loss, which sequence parallelism would replace by the "
                "token-mean loss of the causal LM (or run on one rank's shard): subclass transformers' Trainer or "
                "TRL's SFTTrainer (WallfacerTrainer, WallfacerSFTTrainer), or use WallfacerDPOTrainer / "
                "WallfacerGRPOTrainer for TRL's DPO and GRPO"
            )


def refuse_unsupported(trainer: Any, run: RunConfig) -> None:
    """Raise ``UnsupportedTrainerOption`` for the first Trainer option this path cannot reproduce exactly."""
    refuse_foreign_loss(trainer)
    refuse_common_options(trainer, run)
    args = trainer.args
    if getattr(args, "loss_type", "nll") not in (None, "nll"):
        raise UnsupportedTrainerOption(
            f"loss_type = {getattr(args, 'loss_type', None)!r} is not supported with sequence parallelism yet: the "
            'loss is the token-mean negative log-likelihood; set loss_type="nll"'
        )


def refuse_common_options(trainer: Any, run: RunConfig) -> None:
    """The options every sequence-parallel Trainer refuses, whatever its loss."""
    args = trainer.args
    ds = run.deepspeed
    tbs = ds.get("train_batch_size")
    if tbs is not None and tbs != "auto" and tbs != args.world_size * args.per_device_train_batch_size * \
            args.gradient_accumulation_steps:
        raise UnsupportedTrainerOption(
            f'ds_config train_batch_size = {tbs}: with the Trainer set it to "auto" (the Trainer fills it from '
            "per_device_train_batch_size x gradient_accumulation_steps x world size, every rank counted)"
        )
    refuse_accelerate_sp(getattr(trainer.accelerator, "parallelism_config", None))
    checks = [
        (getattr(trainer, "model_init", None) is not None, "model_init",
         "train() would build a new model without the sequence-parallel setup; pass model= instead"),
        (getattr(trainer, "compute_loss_func", None) is not None, "compute_loss_func",
         "the loss is computed by ds_wallfacer (or the TRL trainer); drop compute_loss_func"),
        (getattr(trainer, "compute_metrics", None) is not None, "compute_metrics",
         "logits are sharded across sequence-parallel ranks; evaluation reports the loss (and TRL's metrics) only"),
        (args.label_smoothing_factor != 0, f"label_smoothing_factor = {args.label_smoothing_factor}",
         "set it to 0"),
        (getattr(args, "neftune_noise_alpha", None) is not None, f"neftune_noise_alpha = {args.neftune_noise_alpha}",
         "the embedding noise would be drawn per shard, not for the whole sequence; set it to None"),
        (args.n_gpu > 1, f"n_gpu = {args.n_gpu} (torch DataParallel)", "launch one process per device"),
        (str(getattr(args, "train_sampling_strategy", "random")) == "batch_rebalance",
         'train_sampling_strategy = "batch_rebalance"', 'use "random" or "group_by_length" (for rounds of even '
         'attention work over the data-parallel replicas: "balance_steps": true in the "wallfacer" section)'),
        (bool(args.accelerator_config.dispatch_batches), "accelerator_config.dispatch_batches",
         "every rank must load its own batches (set dispatch_batches to False)"),
        (bool(args.accelerator_config.split_batches), "accelerator_config.split_batches", "set it to False"),
        (run.wallfacer.dynamic_sequence_parallel is not None, "wallfacer.dynamic_sequence_parallel",
         "the Trainer runs a fixed number of micro-batches per step, each on every rank of its group; train with "
         "ds_wallfacer.integration.initialize and sp.dataloader (each step's rounds, then engine.step()), or drop "
         "the key"),
    ]
    for bad, what, fix in checks:
        if bad:
            raise UnsupportedTrainerOption(f"{what} is not supported with sequence parallelism yet: {fix}")


def refuse_unbalanceable(args: Any, train_dataset: Any) -> None:
    """``"balance_steps": true`` orders the training items itself, so it needs every item weighable up front and
    the Trainer's own ordering off."""
    strategy = str(getattr(args, "train_sampling_strategy", "random"))
    if strategy != "random":
        raise UnsupportedTrainerOption(
            f'wallfacer.balance_steps = true orders the training items itself: train_sampling_strategy = '
            f'"{strategy}" would be ignored; set it to "random" or drop balance_steps'
        )
    if train_dataset is not None and not hasattr(train_dataset, "__len__"):
        raise UnsupportedTrainerOption(
            "wallfacer.balance_steps = true weighs every training item up front: give a map-style train_dataset "
            "(with __len__), not an iterable one, or drop balance_steps"
        )


def refuse_unsupported_model(sp: Any) -> None:
    """The model features whose exact loss needs ds_wallfacer's own loss module (not the Trainer's yet)."""
    module = sp.module
    if module.router_aux is not None:
        raise UnsupportedTrainerOption(
            "this MoE model's router aux loss must be averaged over the whole sequence, which the Trainer path "
            "does not do yet: set output_router_logits=False (or router_aux_loss_coef=0), or train with "
            "ds_wallfacer.integration.initialize / python -m ds_wallfacer.train"
        )
    if module.rope is not None:
        raise UnsupportedTrainerOption(
            "a RoPE type that reads the sequence length (dynamic / longrope) is not supported by the Trainer path "
            "yet: use a fixed RoPE type, or train with ds_wallfacer.integration.initialize"
        )
    ms = sp.config.wallfacer.mini_sequence
    if ms is not None and ms.lm_head:
        raise UnsupportedTrainerOption(
            'wallfacer.mini_sequence.lm_head is not supported by the Trainer path yet: set "lm_head": false '
            "(the chunked MLP still applies)"
        )
