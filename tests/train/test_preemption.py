"""Save on preemption: the trainer on 2 CPU ranks forked from the test process (``helpers.train_on_ranks``).

- SIGUSR1 (what SLURM's ``--signal`` sends; SIGTERM takes the same path) to one rank mid-training: every rank
  finishes its step, saves a checkpoint that verifies, and exits with status 75 and one line saying why;
  ``--resume auto`` then continues, and its losses equal an uninterrupted run's bitwise;
- one rank (no watchdog): the trainer's own signal relay takes SIGTERM the same way;
- without processes: a relayed copy of the first signal is ignored, a second signal ends the rank at once, a
  signal after the save ends it with 75, and the grace runs out with the first signal's status.
The deepspeed launcher's case (SIGTERM to the ``deepspeed`` runner) is in ``test_faults.py``.
"""
from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from ds_wallfacer.train import checkpoint as ckpt
from ds_wallfacer.train import manifest
from ds_wallfacer.train import preempt
from ds_wallfacer.train.preempt import PREEMPTED_EXIT_CODE, Preemption, stop_reason
from tests.train.helpers import losses, summary, train_on_ranks

STEPS = 30


class _Ended(Exception):
    pass


def _preemption(grace_s: float = 0.0) -> tuple[Preemption, list[str], list[tuple[str, int]]]:
    said: list[str] = []
    ended: list[tuple[str, int]] = []
    return Preemption(grace_s=grace_s, end=lambda line, code: ended.append((line, code)), say=said.append), said, ended


def test_first_signal_is_taken_a_relayed_copy_ignored_a_second_one_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    p, said, ended = _preemption()
    assert p.flag() == 0
    p.request_signal(signal.SIGTERM)
    assert p.flag() > 0 and len(said) == 1 and "SIGTERM: finishing this step" in said[0] and not ended
    p.request_signal(signal.SIGTERM)  # the launcher passing the scheduler's signal on: the same request
    assert not ended
    monkeypatch.setattr(preempt, "REPEAT_WINDOW_S", 0.0)
    p.request_signal(signal.SIGTERM)
    assert ended and ended[0][1] == 143 and "second signal" in ended[0][0]


def test_signal_after_the_save_ends_with_75_and_the_grace_with_the_signals_status() -> None:
    p, _, ended = _preemption()
    p.request_launcher_gone("the deepspeed runner of this job (pid 1) is gone")
    assert stop_reason([0, p.flag()]) == "launcher gone on rank 1"
    p.saved()
    p.request_signal(signal.SIGUSR1)
    assert ended == [("SIGUSR1 after the checkpoint was saved", PREEMPTED_EXIT_CODE)]
    p, _, ended = _preemption(grace_s=0.05)
    p.request_signal(signal.SIGUSR1)
    time.sleep(0.3)
    assert len(ended) == 1 and ended[0][1] == 128 + signal.SIGUSR1 and "--preempt_grace_s" in ended[0][0]
    assert stop_reason([p.flag(), p.flag(), 0]) == "SIGUSR1 on ranks 0, 1"


def _signal_ranks(out: Path, sig: signal.Signals, every: bool, done: threading.Event) -> None:
    """Once ``out/metrics.jsonl`` shows step 2: ``sig`` to the last forked rank, or to every one."""
    deadline = time.monotonic() + 240
    log = out / "metrics.jsonl"
    while time.monotonic() < deadline and not done.is_set():
        if log.is_file() and len(log.read_text().splitlines()) >= 2:
            break
        time.sleep(0.05)
    me = psutil.Process()
    ranks = [c for c in me.children() if c.cmdline() == me.cmdline()]  # forked copies, not helpers
    for c in ranks if every else ranks[-1:]:
        c.send_signal(sig)


@pytest.fixture(scope="module")
def common(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("preempt")
    cfg = tmp / "p2.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
        "steps_per_print": 1000, "wallfacer": {"sequence_parallel_size": 2, "mode": "wallfacer", "ring_count": 1},
    }))
    args = ["--deepspeed_config", str(cfg), "--seq_len", "64", "--steps", str(STEPS), "--eval_fraction", "0",
            "--no_wandb", "--no_export", "--no_save", "--cache_dir", str(tmp / "cache")]
    (tmp / "cwd").mkdir()
    summary(train_on_ranks(2, tmp / "cwd", "--output_dir", str(tmp / "ref"), *args))
    return {"tmp": tmp, "args": args, "ref": losses(tmp / "ref")}


@pytest.mark.parametrize("sig,every", [(signal.SIGUSR1, False)], ids=["sigusr1-one-rank"])
def test_a_signal_saves_and_the_resumed_run_is_bitwise(common: dict, sig: signal.Signals, every: bool) -> None:
    tmp, out = common["tmp"], common["tmp"] / sig.name
    done = threading.Event()
    sender = threading.Thread(target=_signal_ranks, args=(out, sig, every, done), daemon=True)
    sender.start()
    res = train_on_ranks(2, tmp / "cwd", "--output_dir", str(out), *common["args"])
    done.set()
    sender.join()
    text = res.stdout + res.stderr
    assert res.returncode == PREEMPTED_EXIT_CODE, text[-4000:]
    stopped = [line for line in res.stderr.splitlines() if line.startswith("ds_wallfacer.train: stopped after step")]
    assert len(stopped) == 1 and f"{sig.name} on rank" in stopped[0] and "--resume auto" in stopped[0], text[-4000:]
    s = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])
    step = s["steps"]
    assert 2 <= step < STEPS and s["checkpoint"].endswith(f"step_{step}") and s["stopped"], s
    tag = ckpt.resolve_resume("auto", out)
    assert tag is not None and tag.name == f"step_{step}"
    assert manifest.problem(tag, json.loads((tag / ckpt.MARKER).read_text())["files"]) is None

    resumed = summary(train_on_ranks(2, tmp / "cwd", "--output_dir", str(out), "--resume", "auto", *common["args"]))
    assert resumed["resumed_from"].endswith(f"step_{step}") and resumed["steps"] == STEPS
    got, want = losses(out), common["ref"]
    assert [got[k] for k in range(1, STEPS + 1)] == [want[k] for k in range(1, STEPS + 1)]  # bitwise


def test_one_rank_without_a_watchdog_saves_on_a_signal_and_resumes_bitwise(tmp_path: Path) -> None:
    """One rank starts no watchdog: the trainer's own signal relay takes SIGTERM to the preemption (save, 75)."""
    cfg = tmp_path / "p1.json"
    cfg.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                               "zero_optimization": {"stage": 1}, "steps_per_print": 1000,
                               "wallfacer": {"sequence_parallel_size": 1}}))
    steps = 12
    args = ["--deepspeed_config", str(cfg), "--seq_len", "64", "--steps", str(steps), "--eval_fraction", "0",
            "--no_wandb", "--no_export", "--no_save", "--cache_dir", str(tmp_path / "cache")]
    (tmp_path / "cwd").mkdir()
    summary(train_on_ranks(1, tmp_path / "cwd", "--output_dir", str(tmp_path / "ref"), *args))
    out = tmp_path / "signalled"
    done = threading.Event()
    sender = threading.Thread(target=_signal_ranks, args=(out, signal.SIGTERM, True, done), daemon=True)
    sender.start()
    res = train_on_ranks(1, tmp_path / "cwd", "--output_dir", str(out), *args)
    done.set()
    sender.join()
    text = res.stdout + res.stderr
    assert res.returncode == PREEMPTED_EXIT_CODE, text[-4000:]
    assert "SIGTERM on rank 0" in text and "--resume auto" in text, text[-4000:]
    step = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])["steps"]
    assert 2 <= step < steps, step
    resumed = summary(train_on_ranks(1, tmp_path / "cwd", "--output_dir", str(out), "--resume", "auto", *args))
    assert resumed["resumed_from"].endswith(f"step_{step}") and resumed["steps"] == steps
    got, want = losses(out), losses(tmp_path / "ref")
    assert [got[k] for k in range(1, steps + 1)] == [want[k] for k in range(1, steps + 1)]  # bitwise
