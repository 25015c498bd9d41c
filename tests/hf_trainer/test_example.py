"""The example scripts ``launch/train_hf.py`` (Trainer), ``launch/train_trl.py`` (TRL SFT), ``train_dpo.py`` and
``train_grpo.py`` on 4 gloo ranks forked from the test process (what the ``deepspeed`` launcher's ranks run): they
train, evaluate, save a checkpoint (the SFT one a LoRA adapter only), log to an offline wandb run (with
``WallfacerTrainer``'s metrics), resume from the checkpoint, and print their JSON summary last."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("accelerate")

# imported once in the parent so the forked ranks share them (see test_trainer_parity.py)
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import transformers.trainer  # noqa: E402,F401

from tests.dist_utils import run_distributed  # noqa: E402
from tests.train.helpers import wandb_history  # noqa: E402

LAUNCH = Path(__file__).resolve().parents[2] / "launch"


def _example_rank(rank: int, world: int, argv: list[str], script: str = "train_hf") -> str:
    import contextlib
    import importlib.util
    import io
    import os

    # the script as its own module: it imports only from the package (ds_wallfacer.examples), no other script
    spec = importlib.util.spec_from_file_location(script, LAUNCH / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    os.environ["WANDB_DIR"] = argv[argv.index("--output_dir") + 1]  # the offline wandb run (WANDB_MODE=offline)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(argv) == 0
    import wandb

    if wandb.run is not None:  # a forked rank ends without atexit hooks, which would finish the run
        wandb.finish()
    return out.getvalue()


def test_the_scripts_import_only_from_the_package() -> None:
    """Every script in launch/ runs from an installed package: no ``sys.path`` edits, no script imports another."""
    import ast

    scripts = {p.stem for p in LAUNCH.glob("*.py")}
    for path in sorted(LAUNCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module]
        assert not scripts & {name.split(".")[0] for name in names}, (path.name, names)
        assert "sys.path" not in path.read_text(), path.name


def _summary(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def test_the_example_trains_saves_resumes_and_prints_its_summary(tmp_path: Path) -> None:
    argv = ["--deepspeed_config", "hybrid", "--seq_len", "128", "--steps", "4", "--eval_steps", "2",
            "--save_steps", "2", "--output_dir", str(tmp_path / "run")]
    first = _summary(run_distributed(_example_rank, 4, [*argv, "--report_to", "wandb"], timeout_s=240)[0])
    assert first["steps"] == 4 and first["sequence_parallel_size"] == 4 and first["mode"] == "hybrid", first
    assert first["tokens_per_s"] > 0 and first["final_loss"] > 0 and first["eval_loss"] > 0, first
    assert (tmp_path / "run" / "checkpoint-4").is_dir()
    (run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    logged = [row for row in wandb_history(run) if "train/loss" in row]
    assert len(logged) == 4, logged
    assert {"train/wallfacer/tokens_per_s", "train/wallfacer/comm/total", "train/wallfacer/peak_memory_bytes"} <= set(
        logged[0]), sorted(logged[0])
    resumed = _summary(run_distributed(_example_rank, 4, [*argv, "--steps", "6", "--resume", "last"],
                                       timeout_s=240)[0])
    assert resumed["steps"] == 6, resumed


def test_the_sft_example_trains_a_lora_adapter_on_packed_chats_and_prints_its_summary(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("peft")
    import peft  # noqa: F401  (imported in the parent, shared by the forked ranks)
    import trl  # noqa: F401

    argv = ["--deepspeed_config", "wallfacer", "--max_length", "256", "--steps", "4", "--eval_steps", "2",
            "--save_steps", "4", "--lora_r", "4", "--output_dir", str(tmp_path / "run")]
    got = _summary(run_distributed(_example_rank, 4, argv, "train_trl", timeout_s=240)[0])
    assert got["steps"] == 4 and got["sequence_parallel_size"] == 4 and got["lora"], got
    assert got["tokens_per_s"] > 0 and got["final_loss"] > 0 and got["eval_loss"] > 0, got
    saved = {p.name for p in (tmp_path / "run" / "checkpoint-4").iterdir()}
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved, saved


@pytest.mark.parametrize("script", ["train_dpo", "train_grpo"])
def test_the_dpo_and_grpo_examples_train_and_print_their_summary(script: str, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    import trl  # noqa: F401  (imported in the parent, shared by the forked ranks)

    argv = ["--deepspeed_config", "wallfacer", "--steps", "2", "--output_dir", str(tmp_path / "run")]
    got = _summary(run_distributed(_example_rank, 4, argv, script, timeout_s=240)[0])
    assert got["steps"] == 2 and got["sequence_parallel_size"] == 4 and got["mode"] == "wallfacer", got
    assert got["tokens_per_s"] > 0 and got["final_loss"] is not None, got
    if script == "train_dpo":
        assert got["eval_loss"] > 0 and 0 <= got["reward_accuracy"] <= 1, got
    else:
        assert got["first_reward"] is not None and got["last_reward"] is not None, got
        shares = [r["prompts"] for r in got["rollouts"]]  # each rank generated its share of the group's prompts
        assert len(shares) == 4 and min(shares) > 0 and max(shares) - min(shares) <= 2, got["rollouts"]
