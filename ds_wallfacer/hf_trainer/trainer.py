"""``WallfacerTrainer``: transformers' ``Trainer`` with sequence parallelism, a one-line change of a Trainer script.

    trainer = WallfacerTrainer(model=model, args=TrainingArguments(..., deepspeed="ds_config.json"), ...)

The hook is the Trainer's construction: ``Trainer.__init__`` has made the accelerator (and torch.distributed,
through DeepSpeed) but no engine yet, so the mixin then takes the ``"wallfacer"`` section out of the ds_config and
does to the model everything ``integration.initialize`` does before ``deepspeed.initialize`` (groups, attention,
RoPE, MsT, the self-check). The Trainer later builds its DeepSpeed engine around the same model, unchanged, with
every rank counted data-parallel (Note [Gradient normalisation across ZeRO stages], docs/design/layouts.md). Loaders, the
token count of each optimizer step, the loss and evaluation are the Trainer's public overridable methods.

Note [Trainer loss under gradient accumulation]. transformers 5 normalises a step's loss by ``num_items_in_batch``:
the non-ignored targets of all micro-batches of the optimizer step, summed over every rank when
``average_tokens_across_devices`` (then each rank's loss is multiplied by the rank count, which DeepSpeed's
average over ranks divides out), or over the rank alone otherwise. Here rank r of W returns
``S_r * W / N``: S_r its shard's summed token losses, N the targets of the step over all ranks (every token is on
exactly one rank). DeepSpeed sums micro-steps and averages over W, so the gradient is that of sum(S) / N, the
non-parallel step's. Without ``average_tokens_across_devices`` the count is the sequence-parallel group's and the
factor P: the mean over replicas of each replica's token mean, as in a D-rank non-parallel run. The logged loss
(the Trainer's mean over ranks) is then the non-parallel number too. Evaluation returns each batch's token mean
over the group, the loss a non-parallel ``prediction_step`` returns for that batch.
"""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from transformers import TrainerCallback

from ..attention.residuals import keep_attention_in_layers
from ..integration.deepspeed import prepare_sequence_parallel
from ..integration.loss import global_token_mean, logits_loss
from ..integration.sequence_parallel import SequenceParallel
from ..data.media import MEDIA_KEYS
from .data import ShardingCollator, replica_dataloader
from .metrics import LogMetrics
from .options import (UnsupportedTrainerOption, refuse_accelerate_sp, refuse_unbalanceable, refuse_unsupported,
                      refuse_unsupported_model, take_wallfacer_section)

__all__ = ["WallfacerTrainer", "WallfacerTrainerMixin"]


class WallfacerTrainerMixin:
    """Sequence parallelism for a ``transformers.Trainer`` subclass (``class T(WallfacerTrainerMixin, Trainer)``).
    ``self.sequence_parallel`` is the ``integration.SequenceParallel`` of the run; ``self.wallfacer_metrics`` the
    counts behind the ``wallfacer/*`` log values (``total_tokens``: real tokens trained on, over all ranks)."""

    loss_is_scaled_for_ga = True  # Note [Trainer loss under gradient accumulation]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        refuse_accelerate_sp(getattr(training_args, "parallelism_config", None))  # before accelerate acts on it
        super().__init__(*args, **kwargs)
        run = take_wallfacer_section(self.args, self.accelerator)
        refuse_unsupported(self, run)
        self.sequence_parallel: SequenceParallel = prepare_sequence_parallel(
            self.model, run, pad_token_id=self._wf_pad_token_id(), seq_len=run.wallfacer.seq_len,
        )
        refuse_unsupported_model(self.sequence_parallel)
        self._wf_balance = run.wallfacer.balance_steps
        if self._wf_balance:
            refuse_unbalanceable(self.args, self.train_dataset)
        self.wallfacer_metrics = LogMetrics(self.sequence_parallel.comm)
        ms = run.wallfacer.mini_sequence
        self.add_callback(_AtTrainBegin(self.wallfacer_metrics, keep_attention=ms is None or ms.keep_attention))

    def _wf_pad_token_id(self) -> int | None:
        tok = getattr(self, "processing_class", None)
        pad = getattr(tok, "pad_token_id", None)
        return int(pad) if pad is not None else None

    # -- data ------------------------------------------------------------------------------------------
    def _wf_dataloader(self, dataset: Any, *, description: str, batch_size: int, sampler: Any) -> Any:
        import datasets

        collator = self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        sp = self.sequence_parallel
        if isinstance(dataset, torch.utils.data.IterableDataset):
            sampler = None
        kwargs = {"num_workers": self.args.dataloader_num_workers, "pin_memory": self.args.dataloader_pin_memory,
                  "persistent_workers": self.args.dataloader_persistent_workers,
                  "drop_last": self.args.dataloader_drop_last}
        return replica_dataloader(
            dataset, batch_size=batch_size, sampler=sampler, spec=sp.groups.shard_spec, accelerator=self.accelerator,
            collate_fn=ShardingCollator(collator, sp.groups.shard_spec, pad_token_id=sp.pad_token_id,
                                        ignore_index=sp.ignore_index, vision=sp.module.vision),
            loader_kwargs=kwargs,
        )

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """The Trainer's sampler; with ``"balance_steps": true``, rounds of one micro-batch per data-parallel
        replica with even attention work (``BalancedStepSampler`` over every replica: accelerate hands batch j to
        replica j mod D), each item weighed once by its documents (``data.loader.item_work``)."""
        dataset = self.train_dataset if train_dataset is None else train_dataset
        if not self._wf_balance:
            return super()._get_train_sampler(dataset)
        from ..data.loader import BalancedStepSampler, item_work

        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        return BalancedStepSampler([item_work(dataset[i]) for i in range(len(dataset))],
                                   batch_size=self._train_batch_size, dp_rank=None,
                                   dp_size=self.sequence_parallel.setup.dims.dp_size, shuffle=True, seed=seed)

    def get_train_dataloader(self) -> Any:
        """The Trainer's training loader, sharded over the data-parallel replicas, each batch sharded over the
        sequence-parallel group (``data.py``)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._wf_dataloader(self.train_dataset, description="Training", batch_size=self._train_batch_size,
                                   sampler=self._get_train_sampler(self.train_dataset))

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        """The evaluation loader, like the training one. With D > 1 replicas every replica must get whole
        batches, so the set's size must divide by D x the batch size (else accelerate repeats samples)."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        dims, bs = self.sequence_parallel.setup.dims, self.args.eval_batch_size
        if dims.dp_size > 1 and hasattr(dataset, "__len__") and len(dataset) % (bs * dims.dp_size):
            raise UnsupportedTrainerOption(
                f"an eval set of {len(dataset)} sequences over {dims.dp_size} data-parallel replicas x "
                f"per_device_eval_batch_size {bs}: give a multiple of {bs * dims.dp_size} sequences, so that every "
                "replica evaluates whole batches and no sequence is counted twice"
            )
        return self._wf_dataloader(dataset, description="Evaluation", batch_size=bs,
                                   sampler=self._get_eval_sampler(dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        """``predict()``'s loader, like the evaluation one: only with ``prediction_loss_only`` (the logits are
        sharded across the sequence-parallel ranks), so ``predict`` returns ``test_loss`` and no predictions."""
        if not self.args.prediction_loss_only:
            raise UnsupportedTrainerOption("predict() returns logits, which are sharded across sequence-parallel "
                                           "ranks: set TrainingArguments(prediction_loss_only=True) for test_loss")
        return self.get_eval_dataloader(test_dataset)

    # -- loss ------------------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The next ``num_batches`` micro-batches and the step's target count (Note [Trainer loss under gradient
        accumulation]): over every rank with ``average_tokens_across_devices``, else over the group."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        sp = self.sequence_parallel
        targets = sum(int((b["shift_labels"] != sp.ignore_index).sum()) for b in batches)
        tokens = sum(int(b["token_mask"].sum()) if "token_mask" in b else b["input_ids"].numel() for b in batches)
        count = torch.tensor([targets, tokens], dtype=torch.int64, device=sp.comm.device)
        with sp.comm.phase("data"):
            per_rank = sp.comm.all_gather(count, dist.group.WORLD).reshape(-1, 2)  # [W, 2], in rank order
        dims = sp.setup.dims
        self.wallfacer_metrics.add_tokens(int(per_rank[:, 1].sum()), int(per_rank[:, 0].sum()))
        if self.args.average_tokens_across_devices:
            total = per_rank[:, 0].sum()
        else:
            total = per_rank[list(dims.sp_ranks(sp.groups.dp_index)), 0].sum()
        return batches, total.to(device)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's log, plus ``wallfacer/*`` (``metrics.py``) on training logs."""
        if "loss" in logs:
            logs = {**logs, **self.wallfacer_metrics.collect()}
        super().log(logs, *args, **kwargs)

    def _wf_model_inputs(self, inputs: dict[str, Any]) -> tuple[Any, torch.Tensor, dict[str, Any]]:
        """(input ids, positions, model keywords) of this rank's shard; packed batches hand attention their documents,
        layers that scale by position get the positions (``SequenceParallelCausalLM.attention_kwargs``)."""
        media = {k: inputs[k] for k in MEDIA_KEYS if inputs.get(k) is not None}  # images: adapters/vision.py
        return self.sequence_parallel.module.model_inputs(
            inputs["input_ids"], inputs["position_ids"], document_starts=inputs.get("document_starts"),
            chunk_assignment=inputs.get("chunk_assignment"), bidirectional_spans=inputs.get("bidirectional_spans"),
            mrope_position_ids=inputs.get("mrope_position_ids"),
            media_index=inputs.get("media_index"), **media)

    def _wf_local_loss(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token losses, targets) of this rank's shard."""
        ids, positions, kwargs = self._wf_model_inputs(inputs)
        return logits_loss(model, input_ids=ids, position_ids=positions, shift_labels=inputs["shift_labels"],
                           ignore_index=self.sequence_parallel.ignore_index, **kwargs)

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """This rank's share of the step's global token-mean loss (Note [Trainer loss under gradient
        accumulation]); without a count, the batch's token mean over the group."""
        if return_outputs:
            raise UnsupportedTrainerOption("compute_loss(return_outputs=True): the outputs are sharded across "
                                           "sequence-parallel ranks and not returned")
        sp = self.sequence_parallel
        loss_sum, count = self._wf_local_loss(model, inputs)
        if num_items_in_batch is None:
            return global_token_mean(loss_sum, count, group=sp.groups.sp_group, comm=sp.comm)
        ranks = self.args.world_size if self.args.average_tokens_across_devices else sp.setup.dims.sp_size
        total = torch.as_tensor(num_items_in_batch, device=loss_sum.device).clamp(min=1)
        return loss_sum * ranks / total

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, None, None]:
        """(the batch's token-mean loss over the group, None, None): evaluation reports the loss only."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None


class _AtTrainBegin(TrainerCallback):
    """When ``Trainer.train`` starts: the first span of the logged metrics begins (not at construction), and the
    layers it has just set to checkpoint (``activation_checkpointing``, turned on after the setup) keep attention's
    results for their recompute (Note [Attention once under layer checkpointing])."""

    def __init__(self, metrics: LogMetrics, *, keep_attention: bool) -> None:
        self.metrics, self.keep_attention = metrics, keep_attention

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        self.metrics.restart()
        if self.keep_attention and model is not None:
            keep_attention_in_layers(model)


try:
    from transformers import Trainer as _Trainer
except ImportError:  # pragma: no cover - transformers is a requirement; only accelerate is optional
    _Trainer = object  # type: ignore[assignment,misc]


class WallfacerTrainer(WallfacerTrainerMixin, _Trainer):  # type: ignore[misc,valid-type]
    """``transformers.Trainer`` with the ds_config's ``"wallfacer"`` sequence parallelism: the one line to change
    in a Trainer script (``Trainer(...)`` -> ``WallfacerTrainer(...)``)."""
