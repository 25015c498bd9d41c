"""A ``deepspeed`` launcher job run in its own session, for tests that signal it while it trains: the output goes
to a file that can be waited on, ranks are found by their command line, and leaving the ``with`` block kills
whatever is left of the session (stopped processes included), so no test leaves a process behind."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.dist_utils import free_port
from tests.train.helpers import DEEPSPEED, ROOT, TRAIN, env

__all__ = ["DEEPSPEED", "Job", "rank_pids"]

QUICK = ("--seq_len", "64", "--no_wandb", "--no_save", "--no_export", "--eval_fraction", "0", "--no_progress")
"""Trainer options that keep a test run small: short sequences, nothing written but metrics."""


class Job:
    """One launcher invocation (``deepspeed [launcher args] launch/train.py [args]``) in a new session."""

    def __init__(self, cmd: list[str], *, cwd: Path, log: Path) -> None:
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.sid = self.proc.pid

    @classmethod
    def trainer(cls, tmp_path: Path, *, num_gpus: int, config: str, args: tuple[str, ...] = (),
                launcher: tuple[str, ...] = (), name: str = "job") -> "Job":
        """The trainer on ``num_gpus`` local ranks with ``ds_configs/<config>`` (or a path) and ``QUICK`` options."""
        cfg = config if os.path.isabs(config) else str(ROOT / "ds_configs" / config)
        port = () if "--master_port" in launcher else ("--master_port", str(free_port()))
        cmd = [DEEPSPEED, "--num_gpus", str(num_gpus), *port, *launcher, str(TRAIN), "--deepspeed_config", cfg,
               "--output_dir", str(tmp_path / f"{name}_out"), *QUICK, *args]
        return cls(cmd, cwd=tmp_path, log=tmp_path / f"{name}.log")

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, *, timeout: float = 240) -> None:
        """Until a line of the output matches ``pattern``; fails with the output's tail if the job ends first."""
        deadline = time.monotonic() + timeout
        rx = re.compile(pattern, re.MULTILINE)
        while not rx.search(self.output()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} never printed (exit {self.proc.poll()}):\n{self.output()[-4000:]}")
            time.sleep(0.2)

    def wait(self, *, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def signal_pid(self, pid: int, sig: signal.Signals) -> None:
        os.kill(pid, sig)

    def interrupt(self) -> None:
        """Ctrl-C as a terminal sends it: SIGINT to every process of the job's process group."""
        os.killpg(self.sid, signal.SIGINT)

    def leftovers(self) -> list[psutil.Process]:
        """Processes still in the job's session (the launcher and its descendants stay in it)."""
        out = []
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and os.getsid(p.pid) == self.sid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error):
                pass
        return out

    def wait_gone(self, *, deadline: float) -> list[psutil.Process]:
        """Until no process of the job's session is left or ``time.monotonic()`` passes ``deadline``; what is left."""
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return left

    def kill(self) -> None:
        for p in self.leftovers():
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped process must be continued to die promptly
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)
        self._out.close()


def rank_pids(job: Job, local_ranks: int) -> dict[int, int]:
    """Local rank -> pid of the trainer processes the launcher started."""
    found: dict[int, int] = {}
    for p in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            m = re.search(r"--local_rank=(\d+)", " ".join(p.cmdline()))
        except psutil.Error:
            continue
        if m and str(TRAIN) in p.cmdline():
            found[int(m.group(1))] = p.pid
    assert sorted(found) == list(range(local_ranks)), found
    return found
