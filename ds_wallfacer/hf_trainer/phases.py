"""Where an RL step's seconds go on each rank: generation, scoring (the old policy's and the reference's
log-probabilities), the rest of the rollout (rewards, advantages, TRL's bookkeeping) and training (the loss's
forward and backward), for ``benchmarks/bench_rl.py`` and the planner's prediction of the same phases
(``planner/rl.py``).

TRL's rollout trainers make a step as the Trainer does: ``training_step`` first calls ``_prepare_inputs``, which on
a generation round generates, scores and computes the rewards, then slices the round's buffer; the rest of
``training_step`` is the loss's forward and backward. Scoring is every call of ``_get_per_token_logps_and_entropies``
made without gradients; it scores the reference when it is given the reference model, or the model with its
adapters off (PEFT: the base model is the reference). On a GPU each phase's end waits for the device, so the
seconds are the device's work and not the launches'.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Any, Iterator

import torch

__all__ = ["PHASES", "PhaseClockMixin"]

PHASES = ("generation", "scoring_policy", "scoring_reference", "rollout_other", "training")
"""The phases ``phase_stats`` reports, seconds per rank since the trainer was built."""


class PhaseClockMixin:
    """Mixed into the rollout trainers before TRL's: the seconds of each phase on this rank (``phase_stats``).
    Generation's seconds are the rollout counts' (``WallfacerRolloutMixin``: generation and the group's gather)."""

    @property
    def _wf_phase_seconds(self) -> defaultdict:
        clock = self.__dict__.get("_wf_phase_clock")
        if clock is None:
            clock = self.__dict__["_wf_phase_clock"] = defaultdict(float)
        return clock

    @contextlib.contextmanager
    def _wf_timed(self, phase: str) -> Iterator[None]:
        self._wf_wait_for_device()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._wf_wait_for_device()
            self._wf_phase_seconds[phase] += time.perf_counter() - t0

    def _wf_wait_for_device(self) -> None:
        device = self.sequence_parallel.comm.device
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._wf_timed("step"):
            return super().training_step(*args, **kwargs)

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        with self._wf_timed("prepare"):
            return super()._prepare_inputs(generation_batch)

    def _get_per_token_logps_and_entropies(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():  # the loss's forward: training
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        phase = "scoring_reference" if self._wf_scores_reference(model) else "scoring_policy"
        with self._wf_timed(phase):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _wf_scores_reference(self, model: Any) -> bool:
        """``model`` is the reference: the reference model itself, or a PEFT model with its adapters off (or its
        adapter named ``ref`` active, as TRL names a reference adapter)."""
        if model is getattr(self, "ref_model", None):
            return True
        if getattr(model, "active_adapter", None) == "ref":
            return True
        for module in model.modules():
            if hasattr(module, "lora_A") and hasattr(module, "disable_adapters"):
                return bool(module.disable_adapters)
        return False

    def phase_stats(self) -> list[dict[str, float]]:
        """Seconds of each of ``PHASES`` on each rank of this rank's group, in group-rank order: generation (the
        rollout counts'), scoring the policy and the reference, the rest of the rollouts, and training (the step
        minus its rollouts). Collective over the group: call it on every rank."""
        sp, clock = self.sequence_parallel, self._wf_phase_seconds
        generation = float(getattr(self, "_wf_rollout_counts", {}).get("seconds", 0.0))
        scoring = clock["scoring_policy"] + clock["scoring_reference"]
        mine = torch.tensor([generation, clock["scoring_policy"], clock["scoring_reference"],
                             max(0.0, clock["prepare"] - generation - scoring),
                             max(0.0, clock["step"] - clock["prepare"])], dtype=torch.float64)
        with sp.comm.phase("data"):
            every = sp.comm.all_gather(sp.comm.place(mine), sp.groups.sp_group).cpu()  # [5] -> [P, 5]
        return [dict(zip(PHASES, row)) for row in every.tolist()]
