"""TRL's DPO, KTO, GRPO and RLOO trainers with sequence parallelism, on 4 gloo ranks, against the same TRL trainer on
one rank (on two for two data-parallel replicas, whose sampling TRL seeds per process) with the same global batch:
every logged loss and metric equal (fp32, 1e-5), the evaluation's too.

The runs (``trl_runs.py``) train the tiny Llama on the shipped arithmetic data with SGD, no clipping, gradient
accumulation 2 (see ``test_trainer_parity.py``). GRPO and RLOO split each rollout over the group (each rank generates
its share of the prompts, rank i sampling from generators seeded ``s + i``). Four cases (``sampling``) sample at
temperature 1 against TRL's trainer generating its prompts in the same slices from the same seeds
(``trl_runs.SlicedRollouts``), so both runs see the same completions and the rewards, advantages and every loss
term, the policy gradient's included, are compared. Two cases decode greedily against plain TRL: the split then
equals one process generating the whole batch (greedy completions of a prompt are alike, so their policy-gradient
terms cancel; ``trl_runs.row_bonus`` gives them different rewards, and with LoRA the adapter starts away from the
base model, so GRPO trains on its KL term). They are the custom rollouts' cases too (``rollout_cases.py``): one trains
on a ``rollout_func``'s rows (each rank calls it on its share and generates there, the group merges the outputs),
whose env mask leaves tokens out of the loss; the other calls tools and an environment in TRL's tool loop (the greedy model is made
to write the calls), whose tool mask leaves the tool results out of the loss, and with LoRA's KL term on every kept
token the loss depends on that mask.

Three of the runs (``resume_checks.RESUMED``: DPO, GRPO, RLOO) also save a checkpoint at step 2, and a second 4-rank run resumes from it
and must continue as the uninterrupted run (``resume_checks.py``).
"""
from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("trl")
pytest.importorskip("peft")

# imported here once, so that the forked ranks share them (see test_trainer_parity.py)
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import peft  # noqa: E402,F401
import transformers.trainer  # noqa: E402,F401
import trl  # noqa: E402,F401

from tests.dist_utils import run_distributed  # noqa: E402

from .resume_checks import RESUMED, assert_resumes, saving  # noqa: E402
from .trl_runs import STEPS, dpo_train, grpo_train, save_tiny_llama  # noqa: E402

_SKIP = ("epoch", "step", "learning_rate", "step_time", "train_runtime", "eval_runtime")


def _same_logs(got: dict, ref: dict, what: str) -> None:
    assert len(got["logs"]) == len(ref["logs"]) == STEPS, (what, got["logs"])
    for step, (a, b) in enumerate(zip(ref["logs"], got["logs"]), 1):
        keys = sorted(k for k in a if not any(s in k for s in _SKIP) and "per_second" not in k)
        assert set(keys) <= set(b), f"{what} step {step}: logged {sorted(b)}, TRL logged {keys}"
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), f"{what} step {step} {k}: {b[k]} != {a[k]} (TRL)"


DPO_CASES = {
    "wallfacer-c2-ref-model": ({"mode": "wallfacer", "ring_count": 2, "sequence_parallel_size": 4}, 2, {}),
    "ulysses-lora-zero3": ({"mode": "ulysses", "sequence_parallel_size": 4}, 2, {"lora": True, "zero_stage": 3}),
    "hybrid-dp-precomputed": ({"mode": "hybrid", "ulysses_degree": 2, "sequence_parallel_size": 2}, 1,
                              {"precompute": True}),
    "ring-ipo-zero3": ({"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 4}, 2,
                       {"loss_type": ["ipo"], "zero_stage": 3}),
    "kto-wallfacer-c2-ref-model": ({"mode": "wallfacer", "ring_count": 2, "sequence_parallel_size": 4}, 2,
                                   {"algo": "kto"}),
}


@pytest.mark.parametrize("case", list(DPO_CASES))
def test_dpo_equals_trl_on_one_rank(case: str, tmp_path) -> None:
    section, micro_batch, opts = DPO_CASES[case]
    ref = run_distributed(dpo_train, 1, str(tmp_path / "p1"), None, 2, opts, timeout_s=240)[0]
    got = run_distributed(dpo_train, 4, str(tmp_path / "p4"), section, micro_batch, saving(case, opts),
                          timeout_s=240)[0]
    assert got["sequence_parallel_size"] == section["sequence_parallel_size"], got
    _same_logs(got, ref, case)
    assert any(v != 0 for k, v in ref["logs"][-1].items() if k.startswith("rewards/")), ref  # the policy moved
    for k, want in ref["eval"].items():
        if not any(s in k for s in _SKIP) and "per_second" not in k:
            assert got["eval"][k] == pytest.approx(want, rel=1e-5, abs=1e-5), (case, k, got["eval"][k], want)
    if case in RESUMED:
        assert_resumes(dpo_train, got, tmp_path / "p4", section, micro_batch, opts, case=case)


GRPO_CASES = {
    "wallfacer-c2-lora": ({"mode": "wallfacer", "ring_count": 2, "sequence_parallel_size": 4}, 8, 1,
                          {"lora": True, "sampling": True}),
    "ulysses-zero3-ref-model-rollout-func": ({"mode": "ulysses", "sequence_parallel_size": 4}, 8, 1,
                                             {"pretrained": True, "zero_stage": 3, "rollout": "scripted"}),
    "hybrid-dr-grpo": ({"mode": "hybrid", "ulysses_degree": 2, "sequence_parallel_size": 4}, 8, 1,
                       {"lora": True, "loss_type": "dr_grpo", "sampling": True}),
    "hybrid-dp-lora-tools": ({"mode": "hybrid", "ulysses_degree": 2, "sequence_parallel_size": 2}, 4, 2,
                             {"lora": True, "loss_type": "dr_grpo", "rollout": "tools"}),
    "rloo-ring-dp": ({"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 2}, 4, 2,
                     {"lora": True, "algo": "rloo", "sampling": True}),
}
"""case: (section, micro-batch, reference ranks, options). ``sampling``: temperature 1, against TRL generating in
the group's slices (``trl_runs.SlicedRollouts``); else greedy, against plain TRL. ``rollout``: a custom rollout
given to both (``rollout_cases.py``): a scripted ``rollout_func`` with an env mask, or tools and an environment."""


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_equals_trl(case: str, tmp_path) -> None:
    section, micro_batch, ref_ranks, opts = GRPO_CASES[case]
    if opts.get("pretrained"):
        opts = {**opts, "pretrained": save_tiny_llama(str(tmp_path / "tiny"))}
    # sampling: each reference process (a replica) generates its prompts in the group's slices, seeded as its ranks
    ref_opts = {**opts, "rollout_parts": section["sequence_parallel_size"]} if opts.get("sampling") else opts
    ref = run_distributed(grpo_train, ref_ranks, str(tmp_path / "ref"), None, 8 // ref_ranks, ref_opts,
                          timeout_s=240)[0]
    got = run_distributed(grpo_train, 4, str(tmp_path / "p4"), section, micro_batch, saving(case, opts),
                          timeout_s=240)[0]
    assert got["sequence_parallel_size"] == section["sequence_parallel_size"], got
    _same_logs(got, ref, case)
    if opts.get("sampling"):  # the policy gradient moves the model (the adapter starts at the base: no KL gradient)
        assert any(log["grad_norm"] > 0 for log in ref["logs"]), ref
        assert len(set(ref["table"]["completion"])) > len(set(ref["table"]["prompt"])), ref["table"]  # sampled
    elif opts.get("lora") and opts.get("algo") != "rloo":  # greedy: the KL to the base model moves the adapter
        assert any(log["grad_norm"] > 0 for log in ref["logs"]), ref
    assert "kl" in ref["logs"][0] and any(k.startswith("clip_ratio") for k in ref["logs"][0]), ref
    # the completions table, row for row
    for column in ("prompt", "completion"):
        assert got["table"][column] == ref["table"][column], (column, got["table"], ref["table"])
    assert got["table"]["advantages"] == pytest.approx(ref["table"]["advantages"], rel=1e-5, abs=1e-5), case
    if opts.get("rollout") == "tools":  # the tools were called, one call failed, and the tool mask took effect
        _tools_took_effect(ref)
    for phases in got["phases"]:  # every rank of rank 0's group: where its seconds went (hf_trainer/phases.py)
        assert phases["generation"] > 0 and phases["training"] > 0, got["phases"]
        assert phases["scoring_reference"] > 0, got["phases"]  # beta > 0
        # the old policy: scored by RLOO always, by GRPO when a round spans optimizer steps (not here)
        assert (phases["scoring_policy"] > 0) == (opts.get("algo") == "rloo"), got["phases"]
    shares = [r["prompts"] for r in got["rollouts"]]  # rank 0's group: each rank generated its share
    assert len(shares) == section["sequence_parallel_size"] and len(set(shares)) == 1, got["rollouts"]
    if case in RESUMED:
        assert_resumes(grpo_train, got, tmp_path / "p4", section, micro_batch, opts, case=case)


def _tools_took_effect(ref: dict) -> None:
    """The tool case's reference run called the environment's tool and the standalone one (their results are tool
    turns of the completions, which TRL's tool mask leaves out of the loss), one call failed, and the environment's
    own reward saw its calls."""
    logs = ref["logs"]
    assert all(log["tools/call_frequency"] > 0 for log in logs), logs
    assert any(log["tools/failure_frequency"] > 0 for log in logs), logs
    assert any(log["rewards/Abacus/mean"] > 0 for log in logs), logs
    called = {m["name"] for c in ref["table"]["completion"] for m in c if m["role"] == "tool"}
    assert called == {"add", "parity"}, ref["table"]["completion"]


def test_sampled_rollouts_split_over_the_group(tmp_path) -> None:
    """Sampling at temperature 1 under ZeRO-3, 2 completions per prompt and one prompt a round: ranks 0 and 1 of
    the group each generate one completion, ranks 2 and 3 none (each generates a dropped one, which keeps ZeRO-3's
    gathers and generate's synced steps aligned). Every rank ends with the same completions and parameters; the
    two completions of a prompt, drawn on two ranks from different seeds, differ; the adapter trains."""
    section = {"mode": "wallfacer", "ring_count": 2, "sequence_parallel_size": 4}
    opts = {"sampling": True, "num_generations": 2, "zero_stage": 3, "lora": True}
    every = run_distributed(grpo_train, 4, str(tmp_path / "p4"), section, 1, opts, timeout_s=240)
    rounds = STEPS  # a round of 2 completions every 2 micro-batches of 1 (steps_per_generation = accumulation 2)
    for got in every[1:]:
        assert got["table"] == every[0]["table"] and got["digest"] == every[0]["digest"], (got, every[0])
    stats = every[0]["rollouts"]
    assert [r["prompts"] for r in stats] == [rounds, rounds, 0, 0], stats
    assert all(r["tokens"] > 0 for r in stats), stats  # the ranks without prompts generated too
    assert {r["batch_tokens"] for r in stats} == {sum(r["tokens"] for r in stats[:2])}, stats
    completions = every[0]["table"]["completion"]
    assert len(completions) == 2 and completions[0] != completions[1], completions
    assert any(log["grad_norm"] > 0 for log in every[0]["logs"]), every[0]["logs"]
