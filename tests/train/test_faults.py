"""Faults through the real ``deepspeed`` launcher and the trainer (2 CPU ranks, a tiny Llama): a rank killed
(SIGKILL) or stopped (SIGSTOP) mid-training ends the whole job non-zero within 60 s of the fault, with one line
naming the rank; Ctrl-C (SIGINT to the launcher's process group, as a terminal sends it) stops every rank with one
line each and no traceback from the ranks; SIGTERM to the ``deepspeed`` runner alone (a scheduler's preemption)
makes every rank save and exit 75. No process of a job outlives its test."""
from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest

from tests.train.jobs import DEEPSPEED, Job, rank_pids

pytestmark = pytest.mark.skipif(DEEPSPEED is None, reason="the deepspeed launcher is not installed")

FAULT_BOUND_S = 60.0
WATCHDOG_S = 10


def _train(tmp_path: Path) -> Job:
    """A 2-rank Ulysses run long enough that the fault always lands mid-training."""
    return Job.trainer(tmp_path, num_gpus=2, config="ulysses.json", args=(
        "--steps", "2000", "--watchdog_timeout", str(WATCHDOG_S)))


def _fault(tmp_path: Path, rank: int, sig: signal.Signals) -> tuple[Job, dict[int, int], float, list]:
    """Start training, wait for step 2, send ``sig`` to ``rank``; returns the job, the rank pids, the seconds
    from the signal to the end of the launcher and the processes of the job still alive after the fault bound."""
    with _train(tmp_path) as job:
        job.wait_for(r"^step 2 loss")
        pids = rank_pids(job, 2)
        t0 = time.monotonic()
        job.signal_pid(pids[rank], sig)
        job.wait(timeout=FAULT_BOUND_S + 30)
        elapsed = time.monotonic() - t0
        return job, pids, elapsed, job.wait_gone(deadline=t0 + FAULT_BOUND_S)


def _tracebacks(out: str) -> list[str]:
    """Each Python traceback in ``out``: its first line to its exception line (the first one not indented)."""
    blocks: list[list[str]] = []
    current: list[str] | None = None
    for line in out.splitlines():
        if "Traceback (most recent call last):" in line:
            current = [line]
            blocks.append(current)
        elif current is not None:
            current.append(line)
            if not line.startswith(" "):
                current = None
    return ["\n".join(b) for b in blocks]


@pytest.mark.parametrize("rank,sig,what", [
    (0, signal.SIGKILL, r"exited"),  # rank 0 also serves the rendezvous store
    (1, signal.SIGSTOP, rf"sent no heartbeat for \d+\.\d s \(timeout {WATCHDOG_S} s\): stalled or stopped"),
], ids=["sigkill-rank0", "sigstop-rank1"])
def test_dead_or_stalled_rank_ends_the_job_and_is_named(tmp_path: Path, rank: int, sig: signal.Signals,
                                                         what: str) -> None:
    job, pids, elapsed, left = _fault(tmp_path, rank, sig)
    out = job.output()
    print(f"{sig.name} rank {rank}: job ended {elapsed:.1f} s after the fault")  # the figure, with pytest -s
    assert job.returncode != 0, out[-3000:]
    assert elapsed < FAULT_BOUND_S, out[-3000:]
    other = 1 - rank
    named = rf"rank {rank} \(host \S+, local rank {rank}, pid {pids[rank]}\)"
    lines = [line for line in out.splitlines() if line.startswith(f"ds_wallfacer watchdog on rank {other} ")]
    assert len(lines) == 1, out[-3000:]  # one line, not one per thread
    assert re.search(named, lines[0]) and re.search(what, lines[0]), lines[0]
    assert _tracebacks(out) == [], out[-3000:]
    assert left == [], f"processes of the job outlived it: {left}"


def test_ctrl_c_stops_every_rank_with_one_line(tmp_path: Path) -> None:
    """Ctrl-C in a terminal (SIGINT to the runner, launch.py and the ranks). (A signal to the ``deepspeed`` runner
    alone, which forwards nothing to its launch.py, leaves the ranks orphaned: they save and stop,
    ``test_sigterm_to_the_runner_saves_a_checkpoint_and_every_rank_exits_75``.)"""
    with _train(tmp_path) as job:
        job.wait_for(r"^step 2 loss")
        t0 = time.monotonic()
        job.interrupt()
        job.wait(timeout=FAULT_BOUND_S)
        left = job.wait_gone(deadline=t0 + FAULT_BOUND_S)  # the runner returns before its launcher is done
    out = job.output()
    assert job.returncode != 0, out[-3000:]
    for rank in (0, 1):
        lines = [line for line in out.splitlines() if line.startswith(f"ds_wallfacer watchdog on rank {rank} ")]
        assert len(lines) == 1 and re.search(r"interrupted \(SIGINT\)", lines[0]), out[-3000:]
    # the deepspeed runner has no SIGINT handler and prints one KeyboardInterrupt traceback of its own; ranks none
    tracebacks = _tracebacks(out)
    assert len(tracebacks) <= 1 and all("deepspeed/launcher/runner.py" in tb for tb in tracebacks), tracebacks
    assert left == [], f"processes of the job outlived it: {left}"


def test_sigterm_to_the_runner_saves_a_checkpoint_and_every_rank_exits_75(tmp_path: Path) -> None:
    """What a scheduler's preemption does to a job started with ``deepspeed``: SIGTERM to the runner, which dies
    without passing it on. Each rank sees its runner gone, the ranks finish the step together, save, and exit with
    status 75 (launch.py reports it); the checkpoint verifies; nothing of the job is left."""
    import json

    from ds_wallfacer.train import checkpoint as ckpt
    from ds_wallfacer.train import manifest

    with _train(tmp_path) as job:
        job.wait_for(r"^step 2 loss")
        t0 = time.monotonic()
        job.signal_pid(job.proc.pid, signal.SIGTERM)
        job.wait(timeout=30)  # the runner dies at once; its launch.py and the ranks go on
        left = job.wait_gone(deadline=t0 + FAULT_BOUND_S)
        elapsed = time.monotonic() - t0
    out = job.output()
    print(f"SIGTERM to the runner: checkpoint saved and ranks gone {elapsed:.1f} s after the signal")
    for rank in (0, 1):
        lines = [line for line in out.splitlines() if line.startswith(f"ds_wallfacer watchdog on rank {rank} ")]
        assert len(lines) == 1 and "the deepspeed runner of this job" in lines[0], out[-3000:]
        assert "saving a checkpoint" in lines[0], lines[0]
    assert "exits with return code = 75" in out, out[-3000:]
    stopped = re.findall(r"^ds_wallfacer\.train: stopped after step (\d+) \(launcher gone on ranks 0, 1\)", out, re.M)
    assert len(stopped) == 1, out[-3000:]
    tag = ckpt.resolve_resume("auto", tmp_path / "job_out")
    assert tag is not None and tag.name == f"step_{stopped[0]}", out[-3000:]
    assert manifest.problem(tag, json.loads((tag / ckpt.MARKER).read_text())["files"]) is None
    assert _tracebacks(out) == [], out[-3000:]
    assert left == [], f"processes of the job outlived it: {left}"
