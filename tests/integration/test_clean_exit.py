"""Note [A clean exit] (docs/trainer.md): a thread still inside a torch.distributed call when the interpreter
finalises aborts the process with "terminate called without an active exception" (exit status -6, after the run
printed its summary); every entry point therefore ends with its threads joined and its process groups destroyed.

The cause reproduced in one process, and gone once ``close_distributed`` runs at exit; ``close_distributed`` on
forked gloo ranks; then the Trainer example and our trainer through the real ``deepspeed`` launcher, each rank
reporting what is left after its last atexit handler (``exit_probe.py``)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port, run_distributed

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "exit_probe.py"
DEEPSPEED = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
LINUX = Path("/proc/self/task").is_dir()


def _close_rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from ds_wallfacer.integration.ds_runtime import close_distributed
    from tests.integration.exit_probe import c10d_threads

    sub = dist.new_group(list(range(world)))
    x = torch.ones(4)
    dist.all_reduce(x, group=sub)
    before = len(c10d_threads())
    del sub
    close_distributed(timeout_s=5.0)
    close_distributed(timeout_s=5.0)  # the second call finds nothing to do
    return {"before": before, "after": len(c10d_threads()), "initialized": dist.is_initialized(),
            "sum": float(x[0])}


def _close_after_uncaught_rank(rank: int, world: int) -> bool:
    import torch.distributed as dist

    from ds_wallfacer.integration.ds_runtime import close_distributed

    sys.last_value = RuntimeError("a failed run")  # what an uncaught exception leaves for the atexit handlers
    try:
        close_distributed()
    finally:
        del sys.last_value
    return dist.is_initialized()


@pytest.mark.skipif(not LINUX, reason="counts threads through /proc")
def test_close_distributed_destroys_the_groups_and_joins_their_threads_twice_safely() -> None:
    got = run_distributed(_close_rank, 2, timeout_s=60)
    for r in got:
        assert r["sum"] == 2.0 and r["before"] > 0, r
        assert not r["initialized"] and r["after"] == 0, r


def test_close_distributed_leaves_the_groups_after_an_uncaught_exception() -> None:
    # a peer may still be inside a collective: destroying would wait for it, and the exit already says it failed
    assert run_distributed(_close_after_uncaught_rank, 2, timeout_s=60) == [True, True]


_STORE_CALL_AT_EXIT = """
import atexit, datetime, sys, threading, time
import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=30))
stop = threading.Event()


def heartbeat():  # the watchdog's shape: store calls (C++, the GIL released) until told to stop
    while not stop.is_set():
        try:
            store.wait(["never"], datetime.timedelta(seconds=0.3))
        except Exception:
            pass


threading.Thread(target=heartbeat, name="ds_wallfacer-test-heartbeat", daemon=True).start()
if sys.argv[1] == "close":
    from ds_wallfacer.integration.ds_runtime import close_distributed

    atexit.register(close_distributed)
    atexit.register(stop.set)  # the owner's stop, then (last in, first out) the join


class SlowTeardown:  # a large process takes this long to finalise
    def __del__(self):
        time.sleep(1.0)


slow = SlowTeardown()
"""


@pytest.mark.parametrize("mode", ["leave", "close"])
def test_a_thread_inside_a_store_call_at_finalisation_aborts_the_process_unless_joined(mode: str,
                                                                                       tmp_path: Path) -> None:
    script = tmp_path / "store_call_at_exit.py"
    script.write_text(_STORE_CALL_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=120)
    if mode == "leave":  # the cause, as a rank of the launcher met it
        assert res.returncode == -6 and "terminate called without an active exception" in res.stderr, res
    else:
        assert res.returncode == 0 and "terminate called" not in res.stderr, res.stderr[-2000:]


def _launch(script: str, *args: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONWARNINGS", "WALLFACER_WARNINGS")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONFAULTHANDLER="1")
    if not shutil.which("nvidia-smi"):
        env["DS_ACCELERATOR"] = "cpu"
    cmd = [DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), str(PROBE), str(ROOT / "launch" / script),
           *args, "--output_dir", str(tmp_path / "run")]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(DEEPSPEED is None or not LINUX, reason="needs the deepspeed launcher and /proc")
@pytest.mark.parametrize("script,args", [
    ("train_hf.py", ("--deepspeed_config", "wallfacer", "--seq_len", "64", "--steps", "1", "--eval_steps", "1")),
    ("train.py", ("--deepspeed_config", str(ROOT / "ds_configs" / "wallfacer.json"), "--seq_len", "64", "--steps",
                  "1", "--no_wandb", "--no_export")),
])
def test_an_entry_point_ends_every_rank_with_status_0_and_its_groups_destroyed(script: str, args: tuple,
                                                                           tmp_path: Path) -> None:
    res = _launch(script, *args, tmp_path=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "terminate called" not in out, out[-4000:]
    json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])  # the summary, last
    left = re.findall(r"exit_probe: rank (\d+): initialized (\w+), (\d+) threads of ours", out)
    assert sorted(rank for rank, _, _ in left) == ["0", "1"], out[-4000:]
    assert all(init == "False" and ours == "0" for _, init, ours in left), [
        line for line in out.splitlines() if "exit_probe" in line]
