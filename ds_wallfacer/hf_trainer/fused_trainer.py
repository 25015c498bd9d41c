"""Sequence parallelism for TRL's trainers whose losses read per-token log-probabilities (DPO, GRPO).

Their ``compute_loss`` is not the token-mean NLL the ``WallfacerTrainerMixin`` replaces: a preference or policy
loss is a function of whole sequences (sums of log-probabilities, ratios, group-normalised rewards). So this mixin
keeps TRL's loss, unchanged, and changes what is under it:

- the data loaders hand every rank of a sequence-parallel group the same full batches (replica-sharded, as
  ``data.py`` does for the Trainer); the batch is token ids and masks only, cheap to hold whole;
- the model's fused LM head runs sequence-parallel (``fused_head.py``): each rank computes its shard's per-token
  values and the group gathers them, so TRL's loss code sees the full [B, N - 1] tensors and computes, on every rank
  of the group, the number a one-process run computes; the reference model gets the same;
- TRL's cross-process gathers count a group as one process (``replicas.py``);
- TRL's own set-up that runs a model before ours exists (DPO's precomputed reference log-probabilities) is deferred
  until the sequence-parallel setup is done.

Subclasses: ``preference.WallfacerDPOTrainer``, ``rl.WallfacerGRPOTrainer``.
"""
from __future__ import annotations

from typing import Any

import torch

from ..adapters import hf
from ..integration.deepspeed import prepare_sequence_parallel
from ..integration.sequence_parallel import SequenceParallel
from .fused_head import shard_fused_lm_head
from .options import (UnsupportedTrainerOption, refuse_accelerate_sp, refuse_common_options, refuse_unsupported_model,
                      take_wallfacer_section)
from .replicas import ReplicaView

__all__ = ["WallfacerFusedHeadMixin", "refuse_absolute_positions"]


def refuse_absolute_positions(model: torch.nn.Module) -> None:
    """Rows moved to start at position 0 (``fused_head.py``) keep rotary attention exact, not learned absolute
    position embeddings: refused by name."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Embedding) and any(k in name.rsplit(".", 1)[-1] for k in ("wpe", "position")):
            raise UnsupportedTrainerOption(
                f"{type(base).__name__} has absolute position embeddings ({name}): TRL's left-padded rows would be "
                "scored at other positions under sequence parallelism; use a model with rotary embeddings"
            )


class WallfacerFusedHeadMixin:
    """The shared part of ``WallfacerDPOTrainer`` and ``WallfacerGRPOTrainer`` (see the module docstring).
    ``self.sequence_parallel`` is the run's ``integration.SequenceParallel``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        refuse_accelerate_sp(getattr(kwargs.get("args"), "parallelism_config", None))
        self._wf_refuse_arguments(kwargs)
        super().__init__(*args, **kwargs)
        run = take_wallfacer_section(self.args, self.accelerator)
        refuse_common_options(self, run)
        self._wf_refuse(run)
        refuse_absolute_positions(self.model)
        # the setup's self-check draws random tokens: keep the global RNG where TRL left it (generation, dropout)
        with torch.random.fork_rng(devices=[]):
            self.sequence_parallel: SequenceParallel = prepare_sequence_parallel(
                self.model, run, pad_token_id=self._tokenizer.pad_token_id, seq_len=run.wallfacer.seq_len,
            )
        sp = self.sequence_parallel
        refuse_unsupported_model(sp)
        shard_fused_lm_head(_hf_model(self.model), sp)
        if getattr(self, "ref_model", None) is not None:
            self._wf_attach_reference(_engine_module(self.ref_model))
        dims = sp.setup.dims
        self._wf_view = ReplicaView(self.accelerator, dims=dims, dp_index=sp.groups.dp_index,
                                    module=_trl_module(type(self)))
        self._wf_after_setup()

    # -- set-up --------------------------------------------------------------------------------------------
    @classmethod
    def _wf_refuse_arguments(cls, kwargs: dict[str, Any]) -> None:
        """The subclass's refusals that read only the constructor's arguments: before TRL acts on them."""

    def _wf_refuse(self, run: Any) -> None:
        """The subclass's own refusals of what TRL's construction made (its TRL options)."""

    def _wf_attach_reference(self, ref: torch.nn.Module) -> None:
        """The reference model attends like the policy: this rank's sequence-parallel attention on its layers,
        its fused LM head sharded. It must be the policy's architecture (its mixers are not attached)."""
        sp = self.sequence_parallel
        policy = _hf_model(self.model)
        if type(ref) is not type(policy):
            raise UnsupportedTrainerOption(
                f"ref_model is a {type(ref).__name__}, the policy a {type(policy).__name__}: under sequence "
                "parallelism the reference must be the policy's architecture"
            )
        if sp.module._mixer_inputs is not None:
            raise UnsupportedTrainerOption(
                f"{type(policy).__name__} has recurrent mixer layers: a separate reference model is not supported "
                "under sequence parallelism yet; train a LoRA adapter (the reference is the base model) instead"
            )
        hf.attach(ref, sp.attention, sp_size=sp.setup.dims.sp_size)
        shard_fused_lm_head(ref, sp)

    def _wf_after_setup(self) -> None:
        """What TRL's construction asked for before the setup existed, and what depends on it (subclasses)."""

    # -- data, loss and logs as one process per replica ------------------------------------------------------
    def _get_dataloader(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's loader, sharded over the replicas (``ReplicaAccelerator.prepare``)."""
        with self._wf_view(self):
            return super()._get_dataloader(*args, **kwargs)

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset
        dataset = dataset if dataset is not None else self.eval_dataset
        dims, bs = self.sequence_parallel.setup.dims, self.args.eval_batch_size
        if dims.dp_size > 1 and hasattr(dataset, "__len__") and len(dataset) % (bs * dims.dp_size):
            raise UnsupportedTrainerOption(
                f"an eval set of {len(dataset)} rows over {dims.dp_size} data-parallel replicas x "
                f"per_device_eval_batch_size {bs}: give a multiple of {bs * dims.dp_size} rows"
            )
        return super().get_eval_dataloader(eval_dataset)

    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        with self._wf_view(self):
            return super().compute_loss(*args, **kwargs)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        with self._wf_view(self):
            super().log(logs, *args, **kwargs)


def _trl_module(cls: type) -> Any:
    """The module of the TRL trainer class ``cls`` derives from (where TRL's own gathers are looked up)."""
    import sys

    return next((sys.modules[c.__module__] for c in cls.__mro__ if c.__module__.startswith("trl.")), None)


def _hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a PEFT wrapper (where TRL put its fused head)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _engine_module(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DeepSpeed engine (TRL prepares the reference model as one)."""
    return getattr(model, "module", model)
