"""The example Trainer script ``launch/train_hf.py`` on 4 gloo ranks forked from the test process (what the
``deepspeed`` launcher's ranks run): it trains, evaluates, saves a checkpoint, logs to an offline wandb run (with
``WallfacerTrainer``'s metrics), resumes from the checkpoint, and prints its JSON summary last."""
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

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train_hf.py"


def _example_rank(rank: int, world: int, argv: list[str]) -> str:
    import contextlib
    import importlib.util
    import io
    import os

    spec = importlib.util.spec_from_file_location("train_hf", SCRIPT)
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
