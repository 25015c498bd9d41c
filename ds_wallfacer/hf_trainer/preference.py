"""``WallfacerDPOTrainer``: TRL's ``DPOTrainer`` with sequence parallelism, one changed line
(``DPOTrainer(...)`` -> ``WallfacerDPOTrainer(...)``, a ``"wallfacer"`` section in the ds_config of
``DPOConfig(deepspeed=...)``).

TRL's DPO loss reads, per pair, the summed log-probabilities of the chosen and rejected completions under the
policy and the reference. Here both models' fused LM heads run sequence-parallel (``fused_head.py``): every rank
scores its shard of each row, the group gathers the per-token values, and TRL's loss (every ``loss_type``,
``ld_alpha``, WPO weighting) and its metrics (rewards, margins, accuracies, log-probabilities, logits, entropy, token
accuracy, token count) are computed on the full tensors, as on one process. The reference is the one TRL uses: a
``ref_model`` (given, or built by TRL from the policy's checkpoint; run under the same sequence parallelism), the
base model under a LoRA adapter, or ``precompute_ref_log_probs=True`` (computed sequence-parallel once, after the
setup, and cached as TRL caches it). Needs ``trl`` (``pip install ds_wallfacer[hf]``).
"""
from __future__ import annotations

from typing import Any

from trl import DPOTrainer

from .fused_trainer import WallfacerFusedHeadMixin
from .options import UnsupportedTrainerOption

__all__ = ["WallfacerDPOTrainer"]


class WallfacerDPOTrainer(WallfacerFusedHeadMixin, DPOTrainer):
    """``trl.DPOTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""

    def _wf_refuse(self, run: Any) -> None:
        if self._is_vision_dataset:
            raise UnsupportedTrainerOption("WallfacerDPOTrainer: image preference data is not supported under "
                                           "sequence parallelism yet; train on text pairs")
        if self.aux_loss_enabled:
            raise UnsupportedTrainerOption("WallfacerDPOTrainer: the MoE router aux loss is not supported under "
                                           "sequence parallelism yet: set router_aux_loss_coef=0")

    def _precompute_ref_logps(self, dataset: Any, name: str, batch_size: int) -> Any:
        """TRL's precompute, run sequence-parallel: during TRL's construction it is deferred to the end of the
        setup (``_wf_after_setup``); afterwards it runs with the loader sharded over the replicas."""
        if self._wf_defer(name, batch_size):
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
