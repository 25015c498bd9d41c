"""TRL's vLLM server mode (``use_vllm=True``, ``vllm_mode="server"``) under sequence parallelism: OUR side of the
protocol on CPU ranks, against a stand-in server (``vllm_standin.py``: the endpoints TRL's ``VLLMClient`` calls, over
a transformers model decoding greedily). It checks our wiring and TRL's client and generation code around it, not
vLLM: real vLLM runs (server and colocated) are in ``benchmarks/gpu_check.sh``, on a GPU.

One case, the hybrid layout with 2 replicas of P = 2 under ZeRO-3 with a LoRA adapter (GRPO, ``dr_grpo``), 4 ranks,
against TRL's own trainer on 2 ranks (one process per replica) with the same server: every logged loss and metric
(the importance-sampling correction's, which reads the server's log-probabilities, included) and the completions
table equal (fp32, 1e-5); the ranks of each group hold the same completions and every rank the same parameters; the
server received what it receives from TRL's run, request for request (one generation request a round with each
replica's prompts once, not P times), and one weight update per optimizer step from one process, every parameter whole
(the LoRA adapter merged) with TRL's run's values; no rank generated.
"""
from __future__ import annotations

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("requests")

# imported here once, so that the forked ranks share them (see test_trainer_parity.py)
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import peft  # noqa: E402,F401
import transformers.trainer  # noqa: E402,F401
import trl  # noqa: E402,F401

from tests.dist_utils import run_distributed  # noqa: E402

from .test_trl_parity import _same_logs  # noqa: E402
from .trl_runs import STEPS, grpo_train  # noqa: E402
from .vllm_standin import StandInServer  # noqa: E402

SECTION = {"mode": "hybrid", "ulysses_degree": 2, "sequence_parallel_size": 2}
OPTIONS = {"lora": True, "loss_type": "dr_grpo", "zero_stage": 3}
ROUND_PROMPTS = 4
"""Unique prompts a round: 2 replicas x micro-batch 4 x 2 micro-batches a round / 4 completions per prompt."""


def test_server_generates_each_replicas_prompts_once(tmp_path) -> None:
    from tests.models import tiny_model

    # the server's own weights differ from the policy's: only TRL's first weight update makes them agree
    server = StandInServer(tiny_model("llama", seed=5), eos_token_id=0)
    url = server.start()
    try:
        opts = {**OPTIONS, "vllm_server": url}
        ref = run_distributed(grpo_train, 2, str(tmp_path / "ref"), None, 4, opts, timeout_s=240)[0]
        ref_events = server.take_events()
        every = run_distributed(grpo_train, 4, str(tmp_path / "p4"), SECTION, 4, opts, timeout_s=240)
        events = server.take_events()
    finally:
        server.stop()
    got = every[0]
    _same_logs(got, ref, "vllm-server")
    assert any(k.startswith("sampling/") for k in ref["logs"][0]), ref["logs"][0]  # importance sampling logged
    for column in ("prompt", "completion"):
        assert got["table"][column] == ref["table"][column], (column, got["table"], ref["table"])
    assert got["table"]["advantages"] == pytest.approx(ref["table"]["advantages"], rel=1e-5, abs=1e-5)
    for other in every[1:]:
        assert other["digest"] == got["digest"], "the ranks ended with different parameters"
    assert every[1]["table"] == got["table"] and every[3]["table"] == every[2]["table"]  # each group: one batch
    # the server: TRL's run's requests, one a round with each replica's prompts once
    assert [e["kind"] for e in events] == [e["kind"] for e in ref_events], (events, ref_events)
    generated = [e for e in events if e["kind"] == "generate"]
    assert [(e["prompts"], e["n"]) for e in generated] == [(ROUND_PROMPTS, 4)] * STEPS, generated
    updates, ref_updates = ([e for e in ev if e["kind"] == "update_weights"] for ev in (events, ref_events))
    assert len(updates) == STEPS and len([e for e in events if e["kind"] == "init"]) == 1, events
    for a, b in zip(updates, ref_updates):
        assert a["digest"] == pytest.approx(b["digest"], rel=1e-5, abs=1e-5)
    assert updates[0]["digest"] != pytest.approx(updates[-1]["digest"], rel=1e-6)  # the merged adapter trained
    stats = got["rollouts"]
    assert [(r["prompts"], r["tokens"]) for r in stats] == [(0, 0)] * 2 and stats[0]["batch_tokens"] > 0, stats


@pytest.mark.parametrize("mode,tp,extra,refused", [
    ("server", 1, {}, None), ("server", 4, {}, None), ("colocate", 1, {}, None),
    ("colocate", 2, {}, "vllm_tensor_parallel_size=2 with vllm_mode='colocate'"),
    ("server", 1, {"rollout_func": len}, "use_vllm=True with rollout_func"),
])
def test_vllm_refusals(mode: str, tp: int, extra: dict, refused: str | None) -> None:
    from ds_wallfacer.hf_trainer import UnsupportedTrainerOption, WallfacerGRPOTrainer

    args = type("Args", (), {"use_vllm": True, "vllm_mode": mode, "vllm_tensor_parallel_size": tp})()
    if refused:
        with pytest.raises(UnsupportedTrainerOption, match=refused):
            WallfacerGRPOTrainer._wf_refuse_arguments({"args": args, **extra})
    else:
        WallfacerGRPOTrainer._wf_refuse_arguments({"args": args})
