"""Checkpoints and resume: the trainer on 4 CPU ranks (forked from the test process: ``helpers.train_on_ranks``).

One uninterrupted run A (P = 4, WallFacer C = 2, MsT, ZeRO-2, 6 steps over 3 epochs, a checkpoint every step,
a ds_config with DeepSpeed's own "wandb" section) of a tiny Llama saved with ``save_pretrained`` beside a
tokenizer trained offline, on .jsonl documents; then
- C: A's output dir as an interruption after step 3 left it (later tags gone, a half-written step_4 that even
  ``latest`` names): ``--resume auto`` picks step_3 and steps 4..6 (an epoch wrap included) equal A's bitwise;
- D: step_3 resumed with another sequence-parallel split of the 4 ranks (P = 2 x D = 2, same global batch):
  steps 4..6 equal A's within fp32 noise;
- E: step_3 resumed on 1 rank through DeepSpeed's universal checkpoint: the same;
- A's wandb run under --output_dir holds every loss; A's HF export loads with plain transformers, without
  ``lm.`` keys, and gives the logits of the consolidated DeepSpeed checkpoint; it loads as ``--model`` too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.train.helpers import jsonl_docs, losses, make_model_dir, summary, train_on_ranks, wandb_history

STEPS = 6


def _config(path: Path, *, sp: int, ring_count: int, micro: int, wandb: bool = False) -> Path:
    cfg = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2}, "steps_per_print": 1000,
        "wallfacer": {"sequence_parallel_size": sp, "mode": "wallfacer", "ring_count": ring_count,
                      "mini_sequence": {"activation_checkpointing": "none"}},
    }
    if wandb:  # DeepSpeed's monitor section: must not take the run away from us
        cfg["wandb"] = {"enabled": True, "project": "wf-resume-test", "group": "resume"}
    path.write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("resume")
    model_dir = make_model_dir(tmp / "model")
    # 5 or 6 sequences of 128 tokens: 1 held out, the rest give 2 steps of 2 sequences per epoch
    data = jsonl_docs(tmp / "docs.jsonl", AutoTokenizer.from_pretrained(str(model_dir)), tokens=5 * 128)
    common = ["--model", str(model_dir), "--data", str(data), "--seq_len", "128", "--steps", str(STEPS),
              "--eval_every", "2", "--seed", "3", "--cache_dir", str(tmp / "cache")]
    cfg_a = _config(tmp / "p4.json", sp=4, ring_count=2, micro=2, wandb=True)
    (tmp / "cwd").mkdir()
    res = train_on_ranks(4, tmp / "cwd", "--deepspeed_config", str(cfg_a), "--output_dir", str(tmp / "a"),
                 "--save_every", "1", *common)
    s = summary(res)
    assert s["train_sequences"] in (4, 5) and s["eval_sequences"] == 1, s
    return {"tmp": tmp, "summary": s, "common": common, "cfg": cfg_a, "model_dir": model_dir}


def test_resume_auto_is_bitwise_and_skips_an_incomplete_save(run_a: dict) -> None:
    tmp, a = run_a["tmp"], run_a["tmp"] / "a"
    c = tmp / "c"
    shutil.copytree(a / "checkpoints", c / "checkpoints")
    for k in range(4, STEPS + 1):
        shutil.rmtree(c / "checkpoints" / f"step_{k}")
    # an interrupted save of step 4: files of one rank, no completion marker; `latest` even names it
    (c / "checkpoints" / "step_4").mkdir()
    shutil.copy(a / "checkpoints" / "step_4" / "mp_rank_00_model_states.pt", c / "checkpoints" / "step_4")
    (c / "checkpoints" / "latest").write_text("step_4")
    res = train_on_ranks(4, tmp / "cwd", "--deepspeed_config", str(run_a["cfg"]), "--output_dir", str(c),
                 "--resume", "auto", "--no_wandb", *run_a["common"])
    s = summary(res)
    assert s["resumed_from"].endswith("step_3") and s["steps_this_run"] == STEPS - 3, s
    want, got = losses(a), losses(c)
    assert sorted(got) == [4, 5, 6]
    assert [got[k] for k in got] == [want[k] for k in got]  # bitwise
    evals_a = [json.loads(x).get("eval_loss") for x in (a / "metrics.jsonl").read_text().splitlines()][3:]
    evals_c = [json.loads(x).get("eval_loss") for x in (c / "metrics.jsonl").read_text().splitlines()]
    assert evals_c == evals_a and evals_c[-1] is not None
    assert s["final_loss"] == run_a["summary"]["final_loss"]


def test_resume_with_another_sequence_parallel_split(run_a: dict) -> None:
    tmp, a = run_a["tmp"], run_a["tmp"] / "a"
    cfg_d = _config(tmp / "p2d2.json", sp=2, ring_count=1, micro=1)
    res = train_on_ranks(4, tmp / "cwd", "--deepspeed_config", str(cfg_d), "--output_dir", str(tmp / "d"),
                 "--resume", str(a / "checkpoints" / "step_3"), "--no_wandb", "--no_export", "--no_save",
                 *run_a["common"])
    s = summary(res)
    assert (s["sequence_parallel_size"], s["data_parallel_size"], s["global_batch"]) == (2, 2, 2)
    got, want = losses(tmp / "d"), losses(a)
    assert sorted(got) == [4, 5, 6]
    for k in got:  # another attention split: fp32 rounding only
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-5), (k, got[k], want[k])


def test_resume_on_another_number_of_ranks_through_a_universal_checkpoint(run_a: dict) -> None:
    tmp, a = run_a["tmp"], run_a["tmp"] / "a"
    cfg_e = _config(tmp / "p1.json", sp=1, ring_count=1, micro=2)
    res = train_on_ranks(1, tmp / "cwd", "--deepspeed_config", str(cfg_e), "--output_dir", str(tmp / "e"),
                 "--resume", str(a / "checkpoints" / "step_3"), "--no_wandb", "--no_export", "--no_save",
                 *run_a["common"])
    s = summary(res)
    assert (s["world_size"], s["sequence_parallel_size"], s["global_batch"]) == (1, 1, 2)
    assert (a / "checkpoints" / "step_3_universal" / "zero").is_dir()
    got, want = losses(tmp / "e"), losses(a)
    assert sorted(got) == [4, 5, 6]
    for k in got:  # ZeRO state gathered onto 1 rank, no sequence parallelism: fp32 rounding only
        assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-5), (k, got[k], want[k])


def test_wandb_section_keeps_every_loss_under_output_dir(run_a: dict) -> None:
    tmp, a, s = run_a["tmp"], run_a["tmp"] / "a", run_a["summary"]
    assert s["steps"] == STEPS and s["finite"] and s["mode"] == "wallfacer" and s["ring_count"] == 2
    assert s["mini_sequence"] and s["eval_loss"] is not None
    runs = list((a / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and s["wandb_dir"] == str(runs[0])
    history = wandb_history(runs[0])
    assert [row["loss"] for row in history if "loss" in row] == [losses(a)[k] for k in range(1, STEPS + 1)]
    assert all("lr" in row and "tokens_per_s" in row and "comm/total" in row for row in history)
    assert not (tmp / "cwd" / "wandb").exists(), "a wandb run was written outside --output_dir"


def test_export_loads_in_plain_transformers_with_the_checkpoint_logits(run_a: dict) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    a = run_a["tmp"] / "a"
    export = Path(run_a["summary"]["export_dir"])
    model = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    assert not [k for k in model.state_dict() if k.startswith("lm.")]
    tok = AutoTokenizer.from_pretrained(str(export))
    text = "Four score and seven years ago our fathers brought forth"
    ids = torch.tensor([tok(text)["input_ids"]])
    assert ids[0].tolist() == AutoTokenizer.from_pretrained(str(run_a["model_dir"]))(text)["input_ids"]

    ref = AutoModelForCausalLM.from_config(model.config).eval()
    state = get_fp32_state_dict_from_zero_checkpoint(str(a / "checkpoints"), tag=f"step_{STEPS}")
    assert all(k.startswith("lm.") for k in state)
    ref.load_state_dict({k[3:]: v for k, v in state.items()})
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits, rtol=0, atol=0)

    import ds_wallfacer.integration  # noqa: F401  registers "wallfacer"
    from ds_wallfacer.train.model import load_model

    again = load_model(str(export), seq_len=128, dtype=torch.float32, seed=0)  # --model for the next run
    assert again.source.startswith("pretrained:") and again.eos_id == tok.eos_token_id
    torch.testing.assert_close(again.model.state_dict(), model.state_dict(), rtol=0, atol=0)
