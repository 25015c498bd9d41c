"""TRL's DPO, GRPO and RLOO trainers with sequence parallelism resume from a Trainer checkpoint as TRL's own resume
does. A parity run of ``test_trl_parity.py`` (4 ranks) saves a checkpoint at step ``SAVE_AT`` and trains on; a
second 4-rank run resumes from it (``trainer.train(resume_from_checkpoint=...)``), trains only the steps after it,
and must log every loss and metric of the uninterrupted run at those steps (fp32, 1e-6). DPO's (and KTO's)
``num_tokens`` counts again from the resume, as in TRL's own resume (TRL keeps that count on the trainer, not in the
checkpoint).

GRPO and RLOO sample at temperature 1, so the resumed step's rollout must draw the prompts and the random numbers
the uninterrupted run drew: the Trainer restores each process's random state from the checkpoint, the ranks of a
group take their first rank's state before every rollout, and TRL's sampler is seeded by ``args.seed``. Their
completions tables (the last round's) and trained parameters are compared too. ``rloo-ring-dp`` runs as 2 replicas
of 2 ranks, so each replica's own state must come back. One resumed run per case: the uninterrupted run is the
parity run itself (one launch fewer per case)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from tests.dist_utils import run_distributed

from .trl_runs import STEPS, dpo_train

__all__ = ["RESUMED", "SAVE_AT", "assert_resumes", "saving"]

SAVE_AT = 2
RESUMED = frozenset({"wallfacer-c2-ref-model", "wallfacer-c2-lora", "rloo-ring-dp"})
"""The parity cases (DPO, GRPO sampled with LoRA, RLOO sampled over 2 replicas) whose run is also resumed. KTO is
DPO's path (the same fused-head trainer and checkpoint; its resume was checked once, equal but for ``num_tokens``)
and is left out to keep the suite within its time."""
_TIMED = ("step_time", "runtime", "per_second")
"""Logged keys that measure time: they differ between any two runs."""


def saving(case: str, opts: dict[str, Any]) -> dict[str, Any]:
    """The parity run's options: a checkpoint at ``SAVE_AT`` where the case is also resumed."""
    return {**opts, "save_steps": SAVE_AT} if case in RESUMED else opts


def _same(got: dict, want: dict, what: str, *, restarted: dict | None = None) -> None:
    """``got``'s values are ``want``'s; ``restarted``: counts TRL restarts from zero on resume, which must be
    ``want``'s less these values (those at the checkpoint)."""
    restarted = restarted or {}
    keys = sorted(k for k in want if not any(t in k for t in _TIMED))
    assert set(keys) <= set(got), f"{what}: logged {sorted(got)}, the uninterrupted run {keys}"
    for k in keys:
        expected = want[k] - restarted.get(k, 0)
        assert got[k] == pytest.approx(expected, rel=1e-6, abs=1e-6), f"{what} {k}: {got[k]} != {expected}"


def assert_resumes(run: Callable, full: dict, out: Path, section: dict, micro_batch: int, opts: dict[str, Any],
                   *, case: str) -> None:
    """Resume ``full`` (a parity run that saved under ``out``) from its checkpoint at ``SAVE_AT``, in ``out``/resumed,
    and compare the two runs."""
    checkpoint = out / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / "trainer_state.json").is_file(), sorted(p.name for p in out.iterdir())
    resumed = run_distributed(run, 4, str(out / "resumed"), section, micro_batch, {**opts, "resume": str(checkpoint)},
                              timeout_s=240)[0]
    assert full["steps_run"] == list(range(1, STEPS + 1)), full
    assert resumed["steps_run"] == list(range(SAVE_AT + 1, STEPS + 1)), resumed  # it did resume
    # the log history holds the checkpoint's steps (its trainer_state.json) and then the resumed run's
    assert [log["step"] for log in resumed["logs"]] == [log["step"] for log in full["logs"]], resumed["logs"]
    # TRL's DPO and KTO count num_tokens on the trainer (_total_train_tokens), which a checkpoint does not hold:
    # TRL's own resume counts it again from zero, and so does this one. GRPO and RLOO keep it in the TrainerState.
    at_checkpoint = next(log for log in full["logs"] if log["step"] == SAVE_AT)
    counted = at_checkpoint["num_tokens"] if run is dpo_train else 0
    restarted = {"num_tokens": counted, "eval_num_tokens": counted}
    for want, got in zip(full["logs"], resumed["logs"]):
        _same(got, want, f"{case} step {want['step']}", restarted=restarted if want["step"] > SAVE_AT else None)
    if "eval" in full:
        _same(resumed["eval"], full["eval"], f"{case} evaluation", restarted=restarted)
    if "table" in full:  # the resumed step's rollout: the same prompts, the same sampled completions
        for column in ("prompt", "completion"):
            assert resumed["table"][column] == full["table"][column], (column, resumed["table"], full["table"])
        assert resumed["table"]["advantages"] == pytest.approx(full["table"]["advantages"], rel=1e-6, abs=1e-6)
        assert len(set(full["table"]["completion"])) > len(set(full["table"]["prompt"])), full["table"]  # sampled
        assert resumed["digest"] == pytest.approx(full["digest"], rel=1e-6, abs=1e-6), case
