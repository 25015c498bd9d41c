"""Non-finite steps: the trainer on 2 CPU ranks forked from the test process (``helpers.train_on_ranks``), with
rank 1's final norm made to output NaN at chosen steps (a forward hook added here, inherited by the forked ranks).

- ZeRO 0 (our gate in front of a plain optimizer) and 3: steps 3-5 poisoned with ``--nonfinite_limit 3``: each is
  logged as skipped naming the ranks of its sequence, the job stops after step 5 with exit status 4 and one line
  naming the steps, the data position and the ranks; the checkpoint after step 4 holds exactly the weights,
  optimizer state and learning-rate schedule of step 2 (no update was applied);
- ZeRO 1 and 2: one poisoned step is skipped the same way, and the run goes on with finite losses.
Ring (WallFacer C = 1) and Ulysses alternate over the stages.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_wallfacer.train.nonfinite import NONFINITE_EXIT_CODE, check_step
from ds_wallfacer.train.trainer import Trainer
from tests.train.helpers import summary, train_on_ranks

_COUNTERS = {"global_steps", "global_samples", "skipped_steps", "wallfacer_train", "iteration", "ds_version",
             "overflow"}
"""Checkpoint entries that count steps taken (skipped or not), the data position, or say the last step was
skipped: they change."""


def _poison(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """Rank 1's final norm outputs NaN in the given (1-based) steps."""
    start = Trainer.start

    def poisoned_start(self: Trainer) -> None:
        start(self)
        if self.rank != 1:
            return
        self.loaded.model.model.norm.register_forward_hook(
            lambda m, i, out: out * float("nan") if self.step + 1 in steps else out)

    monkeypatch.setattr(Trainer, "start", poisoned_start)


def _config(path: Path, *, stage: int, mode: str) -> Path:
    wf = {"sequence_parallel_size": 2, "mode": mode, **({"ring_count": 1} if mode == "wallfacer" else {})}
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                "zero_optimization": {"stage": stage}, "steps_per_print": 1000, "wallfacer": wf}))
    return path


def _run(tmp_path: Path, *, stage: int, mode: str, steps: int, extra: tuple[str, ...] = ()) -> Any:
    (tmp_path / "cwd").mkdir(exist_ok=True)
    return train_on_ranks(2, tmp_path / "cwd", "--deepspeed_config", str(_config(tmp_path / "c.json", stage=stage,
                          mode=mode)), "--seq_len", "64", "--steps", str(steps), "--eval_fraction", "0", "--no_wandb",
                          "--no_export", "--output_dir", str(tmp_path / "out"), "--cache_dir", str(tmp_path / "cache"),
                          *extra)


def _same(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two loaded checkpoint files differ, outside ``_COUNTERS``."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}/{k}: only in one" for k in set(a) ^ set(b)]
        return out + [d for k in set(a) & set(b) - _COUNTERS for d in _same(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: lengths {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if a.shape == b.shape and torch.equal(a, b) else [f"{where}: tensors differ"]
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):  # e.g. DeepSpeed's loss scaler
        return _same(vars(a), vars(b), where)
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _assert_no_update(ckpts: Path, *, before: str, after: str, changed: str) -> None:
    """Every file of tag ``after`` holds what ``before``'s does (weights, optimizer state, learning-rate schedule),
    while ``changed`` (an applied step earlier) differs from ``before``: so the comparison can fail."""
    files = sorted(p.name for p in (ckpts / before).glob("*.pt"))
    assert files and files == sorted(p.name for p in (ckpts / after).glob("*.pt"))
    for name in files:
        a, b = (torch.load(ckpts / t / name, map_location="cpu", weights_only=False) for t in (before, after))
        assert _same(a, b) == [], (name, _same(a, b)[:5])
    assert any(_same(*(torch.load(ckpts / t / name, map_location="cpu", weights_only=False) for t in (changed, before)))
               for name in files), f"{changed} and {before} are the same: the comparison would prove nothing"


def _skipped_steps(out: Path) -> list[tuple[int, str]]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["skipped"]) for r in rows if "skipped" in r]


@pytest.mark.parametrize("stage,mode", [(0, "ulysses"), (3, "wallfacer")])
def test_poisoned_steps_are_skipped_then_stop_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: int,
                                                     mode: str) -> None:
    _poison(monkeypatch, {3, 4, 5})
    res = _run(tmp_path, stage=stage, mode=mode, steps=6, extra=("--save_every", "1", "--nonfinite_limit", "3"))
    text = res.stdout + res.stderr
    assert res.returncode == NONFINITE_EXIT_CODE, text[-4000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("ds_wallfacer.train: error:")]
    assert len(errors) == 1, text[-4000:]
    # one sequence over both ranks (P = 2): its loss is rank 1's and rank 0's
    assert "steps 3-5: non-finite loss on ranks 0, 1" in errors[0] and "epoch 0, sequences 2-4" in errors[0], errors
    assert "3 non-finite step(s) in a row" in errors[0] and "step_4" in errors[0], errors
    skipped = _skipped_steps(tmp_path / "out")
    assert [k for k, _ in skipped] == [3, 4, 5] and "ranks 0, 1" in skipped[0][1]
    ckpts = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_1", "step_2", "step_3", "step_4"]
    _assert_no_update(ckpts, before="step_2", after="step_4", changed="step_1")


@pytest.mark.parametrize("stage,mode", [(1, "wallfacer"), (2, "ulysses")])
def test_one_poisoned_step_is_skipped_and_training_goes_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           stage: int, mode: str) -> None:
    _poison(monkeypatch, {3})
    s = summary(_run(tmp_path, stage=stage, mode=mode, steps=4, extra=("--save_every", "1")))
    assert s["steps"] == 4 and s["skipped_steps"] == 1 and s["finite"] is False, s
    assert [k for k, _ in _skipped_steps(tmp_path / "out")] == [3]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if r["step"] != 3)
    _assert_no_update(tmp_path / "out" / "checkpoints", before="step_2", after="step_3", changed="step_1")


def test_check_step_tells_a_loss_scaler_overflow_from_a_fault() -> None:
    assert check_step([1.0, 2.0], 0.5, applied=True, fp16=False).finite
    bad = check_step([1.0, float("nan")], float("nan"), applied=False, fp16=False)
    assert bad.bad_loss_ranks == (1,) and not bad.finite and "rank 1" in bad.describe()
    assert not check_step([1.0, 1.0], None, applied=False, fp16=False).finite  # DeepSpeed skipped it: its norm
    assert check_step([1.0, 1.0], None, applied=False, fp16=True).finite  # fp16 loss scaling, not a fault
