"""``WallfacerTrainer`` (transformers' real Trainer, real DeepSpeed) on 4 gloo ranks against the plain ``Trainer``
on one rank with the same global batch: every logged training loss and the eval loss equal (fp32, 1e-5).

SGD with ``max_grad_norm=0`` (a gradient off by a constant factor changes the curve; Adam and clipping would hide
it), gradient accumulation 2 with sequences of unequal lengths (so the step's token count, ``num_items_in_batch``,
differs from micro-batch to micro-batch and a mean of means would differ from the token mean), ZeRO-2. The ranks
are forked from the test process (``tests.dist_utils``), which imported torch, DeepSpeed and transformers once.
"""
from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

# imported here once, so that the forked ranks share them (they cost ~30 s per rank on 2 cores otherwise): the
# Trainer with datasets, and the optimizer check DeepSpeed runs for a client-side optimizer (it imports
# torch.compile's stack)
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import transformers.trainer  # noqa: E402,F401

from tests.dist_utils import run_distributed  # noqa: E402

from .runs import STEPS, train  # noqa: E402

ALST_KEYS = {"sequence_parallel_size": 4, "seq_parallel_communication_data_type": "fp32"}
MODES = {
    "ring": ({"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 4}, 1, {}),
    # a ds_config written for DeepSpeed's Ulysses (ALST): its top-level keys, no "wallfacer" section
    "ulysses-alst-keys": (None, 1, {"alst": ALST_KEYS}),
    "hybrid-dp": ({"mode": "hybrid", "ulysses_degree": 2, "sequence_parallel_size": 2}, 2, {}),  # P = 2 x D = 2
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The plain Trainer on one rank: 2 sequences per micro-batch (the global batch of every run below)."""
    out = tmp_path_factory.mktemp("p1")
    (ref,) = run_distributed(train, 1, str(out), None, 2, {"predict": True}, timeout_s=240)
    assert len(ref["losses"]) == STEPS, ref
    assert ref["losses"][STEPS] < ref["losses"][1], ref  # it learns
    return ref


@pytest.mark.parametrize("mode", list(MODES))
def test_losses_and_eval_loss_equal_the_plain_trainer_on_one_rank(mode: str, reference: dict,
                                                                  tmp_path) -> None:
    section, replicas, opts = MODES[mode]
    got = run_distributed(train, 4, str(tmp_path), section, 2 // replicas, {**opts, "predict": True},
                          timeout_s=240)[0]
    assert got["sequence_parallel_size"] == 4 // replicas, got
    assert got["mode"] == (section or {}).get("mode", "ulysses"), got  # DeepSpeed's key means Ulysses
    assert len(got["losses"]) == STEPS, got
    for step, want in reference["losses"].items():
        a = got["losses"][step]
        assert a == pytest.approx(want, rel=1e-5, abs=1e-5), f"{mode} step {step}: {a} != {want} (1 rank)"
    assert got["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5, abs=1e-5), (got, reference)
    assert got["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-5, abs=1e-5), (got, reference)


def test_without_average_tokens_across_devices_equals_the_plain_trainer_on_two_ranks(tmp_path) -> None:
    """``average_tokens_across_devices=False``: each replica's own token mean, averaged over replicas. P = 2 x
    D = 2 against the plain Trainer on D = 2 ranks (one sequence per rank and micro-step in both)."""
    per_replica = {"average_tokens_across_devices": False}
    ref = run_distributed(train, 2, str(tmp_path / "d2"), None, 1, per_replica, timeout_s=240)[0]
    section = {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 2}
    got = run_distributed(train, 4, str(tmp_path / "p2d2"), section, 1, per_replica, timeout_s=240)[0]
    for step, want in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(want, rel=1e-5, abs=1e-5), (step, got["losses"], ref["losses"])
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5, abs=1e-5), (got, ref)
    # what WallfacerTrainer adds to each training log (and so to wandb)
    assert {"wallfacer/tokens_per_s", "wallfacer/comm/total", "wallfacer/peak_memory_bytes"} <= set(got["logged"])



@pytest.mark.parametrize("family", ["qwen3_5", "lfm2"])
def test_recurrent_hybrids_equal_the_plain_trainer_on_one_rank(family: str, tmp_path) -> None:
    """Gated delta-nets and short convolutions through the Trainer path (right-padded batches with an attention
    mask): the hybrid on 4 ranks against the plain Trainer on one."""
    (ref,) = run_distributed(train, 1, str(tmp_path / "one"), None, 2, {"family": family}, timeout_s=240)
    got = run_distributed(train, 4, str(tmp_path / "four"), {"mode": "hybrid", "ulysses_degree": 2,
                                                             "sequence_parallel_size": 4}, 2, {"family": family},
                          timeout_s=240)[0]
    assert len(got["losses"]) == STEPS == len(ref["losses"]), (got, ref)
    for step, want in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(want, rel=1e-5, abs=1e-5), f"{family} step {step}"
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5, abs=1e-5), (got, ref)


def test_vision_language_model_with_images_equals_the_plain_trainer_on_one_rank(tmp_path) -> None:
    """Qwen2.5-VL with images in every sequence through the Trainer path (the user's collator gives pixel_values,
    image_grid_thw, mm_token_type_ids): WallFacer C = 2 on 4 ranks against the plain Trainer on one."""
    opts = {"family": "qwen2_5_vl"}
    (ref,) = run_distributed(train, 1, str(tmp_path / "one"), None, 2, opts, timeout_s=240)
    got = run_distributed(train, 4, str(tmp_path / "four"), {"mode": "wallfacer", "ring_count": 2,
                                                             "sequence_parallel_size": 4}, 2, opts, timeout_s=240)[0]
    assert len(got["losses"]) == STEPS == len(ref["losses"]), (got, ref)
    for step, want in ref["losses"].items():
        assert got["losses"][step] == pytest.approx(want, rel=1e-5, abs=1e-5), f"step {step}"
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5, abs=1e-5), (got, ref)
    assert "pixel_values" in got["batch_keys"] and "mrope_position_ids" in got["batch_keys"], got["batch_keys"]
