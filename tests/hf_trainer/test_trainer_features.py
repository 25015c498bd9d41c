"""``WallfacerTrainer`` on 4 gloo ranks: resuming from a checkpoint the Trainer saved (``save_steps``,
``resume_from_checkpoint``) continues with the losses of the uninterrupted run; packed batches from transformers'
``DataCollatorWithFlattening`` and a ZeRO-3 model from ``from_pretrained`` train with the plain Trainer's losses on
one rank (fp32, 1e-5).
"""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")

# imported once in the parent so the forked ranks share them (see test_trainer_parity.py)
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import transformers.trainer  # noqa: E402,F401

from tests.dist_utils import run_distributed  # noqa: E402

from .runs import STEPS, train  # noqa: E402

RING = {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 4}


def test_resume_from_a_trainer_checkpoint_continues_the_uninterrupted_losses(tmp_path: Path) -> None:
    full = run_distributed(train, 4, str(tmp_path / "full"), RING, 2, {"save_steps": 2}, timeout_s=240)[0]
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file(), sorted(p.name for p in (tmp_path / "full").iterdir())
    resumed = run_distributed(train, 4, str(tmp_path / "resumed"), RING, 2, {"resume": str(checkpoint)},
                              timeout_s=240)[0]
    assert resumed["steps_run"] == list(range(3, STEPS + 1)), resumed  # it did resume
    # the log history holds steps 1-2 from the checkpoint's trainer_state.json and steps 3.. from the resumed run
    assert sorted(resumed["losses"]) == list(range(1, STEPS + 1)), resumed
    for step, loss in resumed["losses"].items():
        assert loss == pytest.approx(full["losses"][step], rel=1e-6, abs=1e-6), (step, loss, full["losses"])
    assert resumed["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-6, abs=1e-6)


def test_packed_batches_from_data_collator_with_flattening(tmp_path: Path) -> None:
    """... with the Trainer's layer checkpointing on (turned on inside ``train``, after the setup)."""
    packed = {"packed": True, "activation_checkpointing": True}
    ref = run_distributed(train, 1, str(tmp_path / "p1"), None, 2, packed, timeout_s=240)[0]
    got = run_distributed(train, 4, str(tmp_path / "p4"), RING, 2, packed, timeout_s=240)[0]
    kept = got["attention_kept"]  # recomputing checkpointed layers reuse attention's results (no second ring pass)
    assert kept["replayed"] > 0 and kept["missed"] == 0, kept
    assert len(ref["losses"]) == STEPS, ref
    assert "position_ids" in ref["batch_keys"], ref  # the collator packs: one row per micro-batch
    assert "document_starts" in got["batch_keys"], got  # ... which the loader turned into documents
    for step, want in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(want, rel=1e-5, abs=1e-5), (step, got["losses"], ref["losses"])
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5, abs=1e-5), (got, ref)


def test_zero3_from_pretrained_equals_the_plain_trainer_on_one_rank(tmp_path) -> None:
    """ZeRO-3 (parameters really partitioned), the model loaded with ``from_pretrained`` after the
    TrainingArguments (so transformers builds it under ``zero.Init``); Ulysses over 4 ranks."""
    from tests.models import tiny_model

    folder = tmp_path / "model"
    tiny_model("llama", seed=0).save_pretrained(str(folder))
    opts = {"zero_stage": 3, "pretrained": str(folder)}
    ref = run_distributed(train, 1, str(tmp_path / "p1"), None, 2, opts, timeout_s=240)[0]
    got = run_distributed(train, 4, str(tmp_path / "p4"), {"mode": "ulysses", "sequence_parallel_size": 4}, 2, opts,
                          timeout_s=240)[0]
    assert got["partitioned"], got
    for step, want in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(want, rel=1e-5, abs=1e-5), (step, got["losses"], ref["losses"])
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5, abs=1e-5), (got, ref)


REFUSALS = ["no section", "compute_metrics", "label smoothing", "train_batch_size", "neftune", "accelerate sp",
            "alst conflict", "own compute_loss"]


@pytest.mark.parametrize("case", REFUSALS)
def test_what_the_trainer_path_cannot_compute_exactly_is_refused_at_construction(case: str, tmp_path: Path) -> None:
    from .runs import ds_config, refusal

    section, kwargs, overrides, words = RING, {}, {}, ""
    if case == "no section":
        section, words = None, 'no "wallfacer" section'
    elif case == "compute_metrics":
        kwargs, words = {"compute_metrics": lambda p: {}}, "compute_metrics is not supported"
    elif case == "label smoothing":
        overrides, words = {"label_smoothing_factor": 0.1}, "label_smoothing_factor = 0.1"
    elif case == "train_batch_size":
        overrides = {"deepspeed": {"train_batch_size": 3, "zero_optimization": {"stage": 2}, "wallfacer": RING}}
        words = 'train_batch_size = 3: with the Trainer set it to "auto"'
    elif case == "neftune":
        overrides, words = {"neftune_noise_alpha": 5.0}, "neftune_noise_alpha = 5.0 is not supported"
    elif case == "accelerate sp":
        from accelerate.parallelism_config import ParallelismConfig

        overrides = {"parallelism_config": ParallelismConfig(sp_backend="deepspeed", sp_size=2)}
        words = 'put "sequence_parallel_size": 2 in the ds_config'
    elif case == "own compute_loss":
        kwargs, words = {"own_loss": True}, "OwnLoss defines its own compute_loss"
    else:  # DeepSpeed's own key against the section's
        overrides = {"deepspeed": ds_config(RING, top_level={"sequence_parallel_size": 2})}
        words = "sequence_parallel_size = 2 (DeepSpeed's key) conflicts with wallfacer.sequence_parallel_size = 4"
    (message,) = run_distributed(refusal, 1, str(tmp_path), section, kwargs, overrides, timeout_s=120)
    assert words in message, message
