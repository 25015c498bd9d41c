"""The newcomer's example through the real ``deepspeed`` launcher (it spawns CPU ranks here): launch/train.py
trains a small Llama on the bundled text and the loss goes down; a bad config stops every rank with one clear
message instead of a hang. The 4-rank run goes through ``exit_probe.py``, so the same launch also shows the clean
exit (Note [A clean exit] in docs/trainer.md): status 0, no abort, no group or thread of ours left at the last
atexit handler of any rank."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.integration.launched import DEEPSPEED, ROOT, clean_exit_failures, launch


pytestmark = pytest.mark.skipif(DEEPSPEED is None, reason="the deepspeed launcher is not installed")


def _launch(num: int, config: Path, tmp_path: Path, *extra: str, timeout: int = 300,
            probe: bool = False) -> subprocess.CompletedProcess:
    return launch("train.py", "--deepspeed_config", str(config), "--output_dir", str(tmp_path / "runs"), *extra,
                  num=num, tmp_path=tmp_path, probe=probe, timeout=timeout)


def test_train_script_hybrid_on_four_ranks(tmp_path: Path) -> None:
    res = _launch(4, ROOT / "ds_configs" / "hybrid.json", tmp_path, "--steps", "4", "--seq_len", "128", probe=True)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "terminate called" not in out, out[-4000:]
    summary = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 4 and summary["finite"]
    assert (summary["mode"], summary["sequence_parallel_size"], summary["ulysses_degree"]) == ("hybrid", 4, 2)
    assert summary["final_loss"] < summary["first_loss"] - 0.3, summary  # it learns
    assert [line.split()[1] for line in res.stdout.splitlines() if line.startswith("step ")] == ["1", "2", "3", "4"]
    assert list((tmp_path / "runs" / "wandb").glob("offline-run-*")), "no offline wandb run was written"
    # a quiet run: no deprecation notice, ours or the packages' (train/quiet.py)
    noise = [line for line in out.splitlines() if "FutureWarning" in line or "DeprecationWarning" in line]
    assert noise == [], noise
    assert clean_exit_failures(res, ranks=4) == []  # every rank's groups destroyed, our threads joined


def test_bad_config_stops_the_run_with_one_clear_message(tmp_path: Path) -> None:
    bad = json.loads((ROOT / "ds_configs" / "wallfacer.json").read_text())
    bad["wallfacer"]["ring_count"] = 2  # 2 ranks: C*C = 4 does not divide 2
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    res = _launch(2, path, tmp_path, "--steps", "1", "--seq_len", "64", "--no_wandb", timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    msg = "wallfacer.ring_count = 2 is invalid for a ring dimension of 2 ranks"
    assert msg in out and "Valid ring counts: [1]" in out, out[-4000:]
