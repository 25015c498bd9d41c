"""Faults injected into real training jobs, and what each costs: the fault table.

    python benchmarks/bench_faults.py              # 2 CPU ranks, a tiny Llama, 40 steps per job (about 3-5 min)

Every job is the trainer under the real ``deepspeed`` launcher (``--num_gpus 2``: CPU ranks where there is no GPU)
with the shipped ``ulysses`` config, 64-token sequences, a checkpoint every 10 steps. One uninterrupted run gives
the reference; then, each in a fresh output folder:

- ``sigterm runner``: SIGTERM to the ``deepspeed`` runner after step 12 (a scheduler's preemption);
- ``sigusr1 ranks``: SIGUSR1 to every rank after step 12 (SLURM's ``--signal``);
- ``sigkill rank 1``: rank 1 killed after step 12 (a node lost): the watchdog ends the job;
- ``truncated ckpt``: the reference's checkpoints with the newest two removed and step_20's rank-1 optimizer file
  cut in half (a copy cut short): ``--resume auto`` must skip it;
- ``disk full``: the output folder on a 10 MiB tmpfs (mounted here when this runs as root, else skipped), room for
  one checkpoint: the second save is refused before writing.
Then ``--resume auto`` (on a roomy disk) to the end. Per fault: seconds from the fault to the job's end, the
checkpoint it left or resumed from, steps redone, the resume's wall time, and its final loss against the
reference's (bitwise equal expected). Non-finite losses are covered by ``tests/train/test_nonfinite.py``.
Prints the table, writes ``runs/bench/faults/result.json`` (``--out``), ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from harness import ROOT, add_out_option, emit, free_port, print_table  # first: the repository on sys.path

STEPS, SAVE_EVERY, FAULT_AT = 40, 10, 12
_OPTS = ("--deepspeed_config", "ulysses", "--seq_len", "64", "--steps", str(STEPS), "--save_every", str(SAVE_EVERY),
         "--eval_fraction", "0", "--no_wandb", "--no_export", "--no_progress", "--watchdog_timeout", "10")


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
    if not shutil.which("nvidia-smi"):
        env["DS_ACCELERATOR"] = "cpu"
    return env


class _Job:
    """``deepspeed --num_gpus 2 launch/train.py`` in its own session, output to a file."""

    def __init__(self, out: Path, *extra: str) -> None:
        self.log = out.with_suffix(".log")
        deepspeed = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
        cmd = [deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), str(ROOT / "launch" / "train.py"),
               *_OPTS, "--output_dir", str(out), *extra]
        self.t0 = time.monotonic()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(cmd, env=_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_step(self, step: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while not re.search(rf"^step {step} loss", self.text(), re.M):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"step {step} never came:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def ranks(self) -> list[psutil.Process]:
        found = [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                 if "--local_rank=" in " ".join(p.cmdline())]
        return sorted(found, key=lambda p: " ".join(p.cmdline()))

    def wait_gone(self, timeout: float = 180) -> float:
        """Until no process of the job's session is left; the seconds since ``self.t0``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [p for p in psutil.process_iter() if _in_session(p, self.proc.pid)]
            if not left:
                break
            time.sleep(0.1)
        self.proc.wait(timeout=30)
        return time.monotonic() - self.t0


def _in_session(p: psutil.Process, sid: int) -> bool:
    try:
        return os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE
    except (ProcessLookupError, psutil.Error):
        return False


def _losses(out: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _checkpoint(out: Path) -> str | None:
    pointer = out / "checkpoints" / "latest"
    return pointer.read_text().strip() if pointer.is_file() else None


def _resume(out: Path) -> dict[str, Any]:
    job = _Job(out, "--resume", "auto")
    wall = job.wait_gone()
    text = job.text()
    line = next((x for x in text.splitlines() if x.startswith("{") and '"resumed_from"' in x), None)
    if job.proc.returncode or line is None:
        raise RuntimeError(f"the resume failed:\n{text[-3000:]}")
    s = json.loads(line)
    return {"resumed_from": Path(s["resumed_from"]).name if s["resumed_from"] else None, "resume_s": wall,
            "final_loss": _losses(out)[STEPS], "skipped": re.findall(r"skipped checkpoint (\S+):", text)}


def _signal_fault(out: Path, kind: str) -> dict[str, Any]:
    job = _Job(out)
    job.wait_step(FAULT_AT)
    ranks = job.ranks()
    t = time.monotonic()
    if kind == "sigterm runner":
        os.kill(job.proc.pid, signal.SIGTERM)
    elif kind == "sigusr1 ranks":
        for p in ranks:
            p.send_signal(signal.SIGUSR1)
    else:
        ranks[1].send_signal(signal.SIGKILL)
    job.t0 = t
    ended = job.wait_gone()
    codes = re.findall(r"exits with return code = (-?\d+)", job.text())
    return {"ended_s": ended, "exit": codes[0] if codes else str(job.proc.returncode), "saved": _checkpoint(out),
            "reached": max(_losses(out))}


def _truncated(ref: Path, out: Path) -> dict[str, Any]:
    shutil.copytree(ref / "checkpoints", out / "checkpoints")
    for k in (30, 40):
        shutil.rmtree(out / "checkpoints" / f"step_{k}")
    (out / "checkpoints" / "latest").write_text("step_20")
    victim = next((out / "checkpoints" / "step_20").glob("zero_pp_rank_1_*optim_states.pt"))
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return {"ended_s": None, "exit": None, "saved": "step_20 (damaged)", "reached": 20}


def _disk_full(out: Path) -> dict[str, Any] | None:
    """The job on a 10 MiB tmpfs; None when no tmpfs can be mounted (not root)."""
    mnt = Path(tempfile.mkdtemp(prefix="wf_tinyfs_"))
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=10m", "tmpfs", str(mnt)], capture_output=True).returncode:
        mnt.rmdir()
        return None
    try:
        job = _Job(mnt / "out")
        job.t0 = time.monotonic()
        ended = job.wait_gone()
        text = job.text()
        refused = re.search(r"error: (no room for checkpoint \S+)", text)
        codes = re.findall(r"exits with return code = (-?\d+)", text)
        shutil.copytree(mnt / "out", out, ignore=shutil.ignore_patterns("token_cache"))
        return {"ended_s": ended, "exit": codes[0] if codes else str(job.proc.returncode),
                "saved": _checkpoint(out), "reached": max(_losses(out)),
                "note": refused.group(1) if refused else "no refusal"}
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)
        mnt.rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out_option(parser, "faults", plot=False)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="wf_faults_"))
    try:
        ref = work / "reference"
        t = time.monotonic()
        job = _Job(ref)
        job.wait_gone()
        ref_loss, ref_s = _losses(ref)[STEPS], time.monotonic() - t
        rows = [{"fault": "none (reference)", "ended_s": None, "exit": "0", "saved": _checkpoint(ref),
                 "resume_s": ref_s, "final_loss": ref_loss}]
        for name in ("sigterm runner", "sigusr1 ranks", "sigkill rank 1", "truncated ckpt", "disk full"):
            out = work / name.replace(" ", "_")
            if name == "truncated ckpt":
                row = _truncated(ref, out)
            elif name == "disk full":
                row = _disk_full(out)
                if row is None:
                    rows.append({"fault": name, "note": "skipped: mounting a tmpfs needs root"})
                    continue
            else:
                row = _signal_fault(out, name)
            row.update(_resume(out), fault=name)
            rows.append(row)
        for r in rows[1:]:
            if "final_loss" in r:
                r["redone"] = r["reached"] - int(r["resumed_from"][len("step_"):])
                r["same_loss"] = r["final_loss"] == ref_loss
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table([("fault", "<"), ("ended s", ".1f"), ("exit", ""), ("left", "<"), ("resumed from", "<"),
                 ("redone", "d"), ("resume s", ".1f"), ("final loss", ".6f"), ("= ref", "")],
                [(r["fault"], r.get("ended_s"), r.get("exit"), r.get("saved"), r.get("resumed_from"),
                  r.get("redone"), r.get("resume_s"), r.get("final_loss"), str(r.get("same_loss", "")))
                 for r in rows], title=f"faults: 2 ranks, {STEPS} steps, a checkpoint every {SAVE_EVERY}, fault after "
                                       f"step {FAULT_AT}")
    for r in rows:
        said = [r.get("note", "")] + [f"skipped {t}" for t in r.get("skipped", [])]
        if any(said):
            print(f"  {r['fault']}: {'; '.join(x for x in said if x)}")
    emit({"rows": rows}, args.out / "result.json",
         line={"faults": len(rows) - 1, "all_equal": all(r.get("same_loss", True) for r in rows[1:])})


if __name__ == "__main__":
    main()
