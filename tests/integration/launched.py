"""A script of launch/ through the real ``deepspeed`` launcher (CPU ranks on gloo here, one rank per GPU where there
are GPUs), optionally under ``exit_probe.py``, and what the probe reported at each rank's exit (Note [A clean exit]
in docs/trainer.md). Shared by the launcher tests of this folder."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.dist_utils import free_port

__all__ = ["DEEPSPEED", "ROOT", "clean_exit_failures", "launch"]

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "exit_probe.py"
DEEPSPEED = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")


def launch(script: str, *args: str, num: int, tmp_path: Path, probe: bool = False,
           timeout: int = 300) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus num launch/<script> args`` from ``tmp_path``, wandb offline, one thread per rank;
    ``probe``: each rank runs the script under ``exit_probe.py``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "WALLFACER_WARNINGS")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONFAULTHANDLER="1")
    if not shutil.which("nvidia-smi"):
        env["DS_ACCELERATOR"] = "cpu"
    target = [str(ROOT / "launch" / script)]
    cmd = [DEEPSPEED, "--num_gpus", str(num), "--master_port", str(free_port()),
           *([str(PROBE)] if probe else []), *target, *args]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


def clean_exit_failures(res: subprocess.CompletedProcess, *, ranks: int) -> list[str]:
    """What keeps a probed launch from a clean exit: a non-zero status, an abort ("terminate called"), a rank that
    did not report, or a rank with a process group or a thread of ours left at its last atexit handler."""
    out = res.stdout + res.stderr
    failures = []
    if res.returncode != 0 or "terminate called" in out:
        failures.append(f"exit status {res.returncode}: {out[-4000:]}")
    left = re.findall(r"exit_probe: rank (\d+): initialized (\w+), (\d+) threads of ours", out)
    if sorted(int(rank) for rank, _, _ in left) != list(range(ranks)):
        failures.append(f"ranks that reported: {[rank for rank, _, _ in left]} of {ranks}: {out[-4000:]}")
    failures += [f"rank {rank}: process group initialized {init}, {ours} threads of ours at exit"
                 for rank, init, ours in left if init != "False" or ours != "0"]
    return failures
