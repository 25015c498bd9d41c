"""TRL's ``SFTTrainer`` and PEFT's LoRA with sequence parallelism, on 4 gloo ranks against the same trainer on one
rank with the same global batch: every logged loss and the eval loss equal (fp32, 1e-5).

The SFT runs use the shipped chat data, packed (several conversations per padding-free row, ``position_ids``
restarting at each) with the loss on assistant turns only; SGD, no clipping, gradient accumulation 2 (see
``test_trainer_parity.py``). LoRA is passed to ``SFTTrainer`` as ``peft_config`` (how TRL users train it), and
wrapped by ``get_peft_model`` for the plain Trainer; only the adapter trains and is saved.

Images: the WallFacer C = 2 launch and the full-model reference's also train TRL's ``SFTTrainer`` on the shipped
image conversations (``examples/vlm_chat.py``: TRL's ``"messages"`` + ``"images"`` rows, the tiny LLaVA with its
``LlavaProcessor``, TRL's vision collator: right-padded rows, the loss on assistant turns only), a second trainer in
the same processes. Every run compares every value TRL logs, its own metrics (entropy, token accuracy, tokens)
included, at every step and in the evaluation. A collator whose batches hold a key the loader does not shard
(``token_type_ids``) is refused at construction.
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

from .runs import STEPS, sft_train, train  # noqa: E402

SFT_MODES = {
    "wallfacer-c2": ({"mode": "wallfacer", "ring_count": 2, "sequence_parallel_size": 4}, 1, {"then_images": True}),
    "ulysses-lora-zero3": ({"mode": "ulysses", "sequence_parallel_size": 4}, 1, {"lora": True, "zero_stage": 3}),
    "hybrid-dp-lora": ({"mode": "hybrid", "ulysses_degree": 2, "sequence_parallel_size": 2}, 2, {"lora": True}),
}


def _same_curve(got: dict, ref: dict, what: str) -> None:
    assert len(got["losses"]) == STEPS, got
    for step, want in ref["losses"].items():
        a = got["losses"][step]
        assert a == pytest.approx(want, rel=1e-5, abs=1e-5), f"{what} step {step}: {a} != {want} (1 rank)"
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5, abs=1e-5), (what, got, ref)


_GRAD_NORM_TOL = 5e-5
"""The gradient norm: a square root of a sum over every parameter, which ZeRO-3 reduces partition by partition
(the reference runs ZeRO-2); after steps at learning rate 1 it was measured 1.8e-5 apart (LoRA, Ulysses, ZeRO-3)."""


def _same_logs(got: dict, ref: dict, what: str, *, replicas: int = 1) -> None:
    """Every value TRL logs at every step (its metrics included: ``entropy``, ``mean_token_accuracy``,
    ``num_tokens``) and at the evaluation, equal. With D > 1 replicas the evaluation's entropy and accuracy are
    per round of D sequences (TRL on D processes gathers them so too), the reference's per sequence: not compared."""
    assert len(got["logs"]) == len(ref["logs"]) == STEPS, (got["logs"], ref["logs"])
    for step, (a, b) in enumerate(zip(ref["logs"], got["logs"]), 1):
        keys = [k for k in a if k not in ("epoch", "step", "learning_rate")]
        assert {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"} <= set(keys) <= set(b), (keys, b)
        for k in keys:
            tol = _GRAD_NORM_TOL if k == "grad_norm" else 1e-5
            assert b[k] == pytest.approx(a[k], rel=tol, abs=tol), f"{what} step {step} {k}: {b[k]} != {a[k]} (TRL)"
    for k, want in ref["eval"].items():
        per_round = replicas > 1 and k in ("eval_entropy", "eval_mean_token_accuracy")
        if "runtime" not in k and "per_second" not in k and k != "epoch" and not per_round:
            assert got["eval"][k] == pytest.approx(want, rel=1e-5, abs=1e-5), (what, k, got["eval"][k], want)


def _same_image_sft(got: dict, ref: dict) -> None:
    """The image conversations: TRL's vision collator gave the Wallfacer trainer its images (sharded batches with
    ``pixel_values`` and each token's feature row), and every logged value is TRL's."""
    assert "pixel_values" in ref["batch_keys"] and {"pixel_values", "media_index"} <= set(got["batch_keys"]), got
    assert ref["losses"][STEPS - 1] < ref["losses"][1], ref  # it trains (the last step's batch is a harder one)
    _same_logs(got, ref, "images")
    assert "['token_type_ids']" in got["refusal"] and "does not shard" in got["refusal"], got["refusal"]


@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """SFTTrainer on one rank, 2 packed rows per micro-batch (the global batch of every run below), full model and
    LoRA."""
    refs = {}
    for lora in (False, True):
        out = tmp_path_factory.mktemp("sft1")
        (ref,) = run_distributed(sft_train, 1, str(out), None, 2, {"lora": lora, "then_images": not lora},
                                 timeout_s=240)
        assert ref["losses"][STEPS] < ref["losses"][1], ref  # it learns
        assert ref["documents"] >= 4, ref  # several conversations per packed row
        refs[lora] = ref
    return refs


@pytest.mark.parametrize("mode", list(SFT_MODES))
def test_sft_packed_assistant_only_equals_sft_on_one_rank(mode: str, sft_reference: dict, tmp_path) -> None:
    section, replicas, opts = SFT_MODES[mode]
    got = run_distributed(sft_train, 4, str(tmp_path), section, 2 // replicas, opts, timeout_s=240)[0]
    assert got["sequence_parallel_size"] == section["sequence_parallel_size"], got
    ref = sft_reference[bool(opts.get("lora"))]
    _same_curve(got, ref, mode)
    _same_logs(got, ref, mode, replicas=replicas)
    if opts.get("lora"):
        assert got["trainable"] == ref["trainable"] and all("lora_" in n for n in got["trainable"]), got
    if opts.get("then_images"):
        _same_image_sft(got["images"], ref["images"])


def test_lora_with_the_plain_trainer_equals_one_rank_and_saves_only_the_adapter(tmp_path) -> None:
    opts = {"lora": True, "save_steps": STEPS}
    ref = run_distributed(train, 1, str(tmp_path / "p1"), None, 2, opts, timeout_s=240)[0]
    section = {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 4}
    got = run_distributed(train, 4, str(tmp_path / "p4"), section, 2, opts, timeout_s=240)[0]
    _same_curve(got, ref, "ring + LoRA")
    assert "adapter_model.safetensors" in got["saved"], got["saved"]
    assert not any(n.startswith("model") and n.endswith(".safetensors") for n in got["saved"]), got["saved"]
