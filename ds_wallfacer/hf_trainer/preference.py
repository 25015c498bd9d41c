"""``WallfacerDPOTrainer`` and ``WallfacerKTOTrainer``: TRL's ``DPOTrainer`` and ``KTOTrainer`` with sequence
parallelism, one changed line (``DPOTrainer(...)`` -> ``WallfacerDPOTrainer(...)``, ``KTOTrainer(...)`` ->
``WallfacerKTOTrainer(...)``, a ``"wallfacer"`` section in the ds_config of ``DPOConfig(deepspeed=...)`` /
``KTOConfig(deepspeed=...)``).

TRL's DPO loss reads, per pair, the summed log-probabilities of the chosen and rejected completions under the
policy and the reference. Here both models' fused LM heads run sequence-parallel (``fused_head.py``): every rank
scores its shard of each row, the group gathers the per-token values, and TRL's loss (every ``loss_type``,
``ld_alpha``, WPO weighting) and its metrics (rewards, margins, accuracies, log-probabilities, logits, entropy, token
accuracy, token count) are computed on the full tensors, as on one process. The reference is the one TRL uses: a
``ref_model`` (given, or built by TRL from the policy's checkpoint; run under the same sequence parallelism), the
base model under a LoRA adapter, or ``precompute_ref_log_probs=True`` (computed sequence-parallel once, after the
setup, and cached as TRL caches it). KTO is the same with unpaired completions (a desirable / undesirable
label each) and its KL term over mismatched prompt-completion pairs, scored the same way. Needs ``trl``
(``pip install ds_wallfacer[hf]``).
"""
from __future__ import annotations

from typing import Any

from trl import DPOTrainer, KTOTrainer

from .fused_trainer import WallfacerFusedHeadMixin
from .options import UnsupportedTrainerOption

__all__ = ["WallfacerDPOTrainer", "WallfacerKTOTrainer", "WallfacerPreferenceMixin"]


class WallfacerPreferenceMixin(WallfacerFusedHeadMixin):
    """What TRL's preference trainers (DPO, KTO) need beyond the fused head: their reference log-probabilities
    precomputed after the setup, and their refusals."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._wf_deferred: list[tuple[str, int]] = []  # precomputes TRL asks for before the setup exists
        super().__init__(*args, **kwargs)

    def _wf_refuse(self, run: Any) -> None:
        name = type(self).__name__
        if self._is_vision_dataset:
            raise UnsupportedTrainerOption(f"{name}: image preference data is not supported under sequence "
                                           "parallelism yet; train on text")
        if self.aux_loss_enabled:
            raise UnsupportedTrainerOption(f"{name}: the MoE router aux loss is not supported under sequence "
                                           "parallelism yet: set router_aux_loss_coef=0")

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's precompute, run sequence-parallel: during TRL's construction it is deferred to the end of the
        setup (``_wf_after_setup``); afterwards it runs with the loader sharded over the replicas."""
        if not hasattr(self, "sequence_parallel"):
            self._wf_deferred.append((name, batch_size))
            return dataset
        with self._wf_view(self):
            return super()._precompute_ref_logps(dataset, name, batch_size)

    def _wf_after_setup(self) -> None:
        for name, batch_size in self._wf_deferred:
            if name == "train":
                self.train_dataset = self._precompute_ref_logps(self.train_dataset, name, batch_size)
            elif isinstance(self.eval_dataset, dict):
                self.eval_dataset[name] = self._precompute_ref_logps(self.eval_dataset[name], name, batch_size)
            else:
                self.eval_dataset = self._precompute_ref_logps(self.eval_dataset, name, batch_size)
        self._wf_deferred.clear()


class WallfacerDPOTrainer(WallfacerPreferenceMixin, DPOTrainer):
    """``trl.DPOTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""


class WallfacerKTOTrainer(WallfacerPreferenceMixin, KTOTrainer):
    """``trl.KTOTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""
