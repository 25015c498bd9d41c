"""``WallfacerSFTTrainer``: TRL's ``SFTTrainer`` with sequence parallelism, the same one-line change as
``WallfacerTrainer`` (``SFTTrainer(...)`` -> ``WallfacerSFTTrainer(...)``, a ``"wallfacer"`` section in the
ds_config of ``SFTConfig(deepspeed=...)``).

TRL prepares the data as usual (chat template, ``assistant_only_loss`` / ``completion_only_loss`` labels,
``packing`` into padding-free rows whose ``position_ids`` restart at every conversation; with a processor and
``"images"`` in the dataset, its vision collator's right-padded rows with ``pixel_values``); the mixin's loader then
shards each collated batch, reads the conversations from ``position_ids`` and trains them as separate documents,
and hands the images to every rank of the group (whose vision adapter splits the tower's work). The loss is the
mixin's global token mean: TRL's ``nll``. TRL's metrics (``entropy``, ``mean_token_accuracy``, ``num_tokens``)
are computed on each rank's shard from its logits and summed over every rank: the numbers TRL logs for the same
batches. TRL's fused LM head is not used, and ``loss_type="dft"`` is refused (``options.refuse_unsupported``); so is
a dataset with images that the model's vision adapter refuses, or whose collated batches hold keys the loader does
not shard (``refuse_unshardable_images``).
Needs ``trl`` (``pip install ds_wallfacer[hf]``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from trl import SFTTrainer

from ..data.loader import TEXT_KEYS
from ..data.media import MEDIA_KEYS, TOKEN_TYPES_KEY
from ..integration.loss import lm_logits
from .options import UnsupportedTrainerOption
from .trainer import WallfacerTrainerMixin

__all__ = ["WallfacerSFTTrainer", "refuse_unshardable_images", "token_stats"]


def refuse_unshardable_images(trainer: Any) -> None:
    """TRL found images in the dataset: the model's vision adapter must take them (a model without one refuses
    them), and TRL's collated batch of the first training example may hold only keys the loader shards (a
    processor's other outputs, e.g. ``token_type_ids``, would not reach the model)."""
    vision = trainer.sequence_parallel.module.vision
    if vision is None or vision.refusal:
        raise UnsupportedTrainerOption(
            f"the dataset has images, but {type(trainer.model).__name__} "
            + (f"refuses them under sequence parallelism: {vision.refusal}" if vision is not None else
               "has no vision tower ds_wallfacer adapts")
        )
    example = dict(next(iter(trainer.train_dataset)))  # a copy: TRL's collator renames keys in place
    batch = trainer.data_collator([example])
    types = getattr(vision, "type_spans", None)  # Gemma 3's and PaliGemma's token_type_ids: the loader's spans
    unknown = sorted(set(batch) - TEXT_KEYS - {*MEDIA_KEYS, TOKEN_TYPES_KEY} - ({types.key} if types else set()))
    if unknown:
        raise UnsupportedTrainerOption(
            f"the collated batches of this dataset hold {unknown} (from {type(trainer.data_collator).__name__} and "
            f"{type(trainer.processing_class).__name__}), which the sequence-parallel loader does not shard and the "
            "model would not get: drop them in a data_collator of your own, or train without sequence parallelism"
        )


def token_stats(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int) -> torch.Tensor:
    """[entropy sum, correct top-1 predictions, targets] over the positions with a target (``logits`` [T, V]
    fp32, ``labels`` [T]): TRL's SFT metrics before their sum over ranks. Top-1 is the first maximum, as TRL's."""
    valid = labels != ignore_index
    logp = F.log_softmax(logits[valid], dim=-1)
    entropy = -(logp.exp() * logp).sum(-1)
    correct = logits[valid].argmax(-1) == labels[valid]
    return torch.stack([entropy.double().sum(), correct.double().sum(), valid.double().sum()])


class WallfacerSFTTrainer(WallfacerTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if getattr(self, "_is_vision_dataset", False):  # TRL's own test: "image" or "images" in the first example
            refuse_unshardable_images(self)

    def _wf_local_loss(self, model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed token losses, targets) of this rank's shard, and TRL's metrics of the batch (``_wf_log_stats``)."""
        ignore = self.sequence_parallel.ignore_index
        ids, positions, kwargs = self._wf_model_inputs(inputs)
        logits = lm_logits(model, input_ids=ids, position_ids=positions, **kwargs)
        flat = logits.float().reshape(-1, logits.shape[-1])
        labels = inputs["shift_labels"].reshape(-1).to(flat.device)
        loss_sum = F.cross_entropy(flat, labels, ignore_index=ignore, reduction="sum")
        with torch.no_grad():
            self._wf_log_stats(token_stats(flat.detach(), labels, ignore_index=ignore), inputs)
        return loss_sum, (labels != ignore).sum()

    def _wf_log_stats(self, stats: torch.Tensor, inputs: dict[str, Any]) -> None:
        """TRL's ``compute_loss`` metrics from this rank's [entropy sum, correct, targets]: summed with the real
        tokens over every rank (each token is on exactly one rank of its group; TRL gathers over every process),
        appended per micro-batch as TRL appends them; ``num_tokens`` counts the real tokens trained on so far."""
        metrics = getattr(self, "_metrics", None)
        if metrics is None:  # a TRL without SFT metrics
            return
        sp = self.sequence_parallel
        tokens = int(inputs["token_mask"].sum()) if "token_mask" in inputs else inputs["input_ids"].numel()
        local = torch.cat([stats, torch.tensor([tokens], dtype=torch.float64, device=stats.device)])
        with sp.comm.phase("metrics"):
            total = sp.comm.all_gather(sp.comm.place(local), dist.group.WORLD).sum(0)  # [4], in rank order
        entropy, correct, valid, real = total.tolist()
        mode = "train" if self.model.training else "eval"
        metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(real)
        metrics[mode]["num_tokens"] = [self._total_train_tokens]
