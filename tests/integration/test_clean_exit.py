"""Note [A clean exit] (docs/trainer.md): a thread that needs the GIL back while the interpreter finalises (a gloo
worker handing back the tensors of a collective that just ended, a thread of ours inside a store call) aborts the
process with "terminate called without an active exception" (exit status -6, after the run printed its summary);
every entry point therefore ends with ``close_distributed``.

Both causes reproduced, and gone once ``close_distributed`` runs; ``close_distributed`` on forked gloo ranks; then
the Trainer example through the real ``deepspeed`` launcher, each rank reporting what is left after its last atexit
handler (``exit_probe.py``; our trainer's launch in ``test_launcher.py`` goes through the same probe)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port, run_distributed
from tests.integration.launched import DEEPSPEED, ROOT, clean_exit_failures, launch

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


def _assert_exit(res: subprocess.CompletedProcess, mode: str) -> None:
    """``mode`` "leave": the process aborted at finalisation (-6, C++'s message); "close": it ended cleanly."""
    if mode == "leave":
        assert res.returncode == -6 and "terminate called without an active exception" in res.stderr, res
    else:
        assert res.returncode == 0 and "terminate called" not in res.stderr, res.stderr[-2000:]


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
    def __del__(self, sleep=time.sleep):  # bound now: module globals are gone by then
        sleep(1.0)


slow = SlowTeardown()
"""


@pytest.mark.parametrize("mode", ["leave", "close"])
def test_a_thread_inside_a_store_call_at_finalisation_aborts_the_process_unless_joined(mode: str,
                                                                                       tmp_path: Path) -> None:
    script = tmp_path / "store_call_at_exit.py"
    script.write_text(_STORE_CALL_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(script), mode], env=env, capture_output=True, text=True, timeout=120)
    _assert_exit(res, mode)  # "leave": the cause, as a rank of the launcher met it


_WORKER_AT_EXIT = """
import sys, time
import torch, torch.distributed as dist

# the main thread keeps the GIL unless it blocks: the race below then goes the bad way every time
sys.setswitchinterval(1000.0)
dist.init_process_group("gloo")
held = dist.group.WORLD  # as a DeepSpeed engine holds its groups: they outlive destroy_process_group
t = torch.ones(1024)
if dist.get_rank() == 1:
    time.sleep(0.5)
    dist.all_reduce(t)
else:
    # the handle dropped: when the collective ends, the gloo worker drops the last reference to its work and with it
    # its reference to t, whose Python object it must release under the GIL
    dist.all_reduce(t, async_op=True)
    sum(range(50_000_000))  # C code holding the GIL: the worker finishes meanwhile and waits for it
    if sys.argv[1] == "close":
        from ds_wallfacer.integration.ds_runtime import close_distributed

        close_distributed()


class SlowTeardown:  # finalisation lets the GIL go somewhere: to the waiting worker, which then must exit
    def __del__(self, sleep=time.sleep):  # bound now: module globals are gone by then
        sleep(0.5)


slow = SlowTeardown()
"""


@pytest.mark.parametrize("mode", ["leave", "close"])
def test_a_gloo_worker_handing_back_a_tensor_at_finalisation_aborts_the_rank_unless_closed(mode: str,
                                                                                          tmp_path: Path) -> None:
    script = tmp_path / "worker_at_exit.py"
    script.write_text(_WORKER_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    peer = subprocess.Popen([sys.executable, str(script), mode], env=dict(env, RANK="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        res = subprocess.run([sys.executable, str(script), mode], env=dict(env, RANK="0"), capture_output=True,
                             text=True, timeout=120)
    finally:
        peer.wait(timeout=120)
    _assert_exit(res, mode)  # "leave": the cause, as rank 0 of a Trainer run met it after its summary


@pytest.mark.skipif(DEEPSPEED is None or not LINUX, reason="needs the deepspeed launcher and /proc")
@pytest.mark.parametrize("script,args", [
    ("train_hf.py", ("--deepspeed_config", "wallfacer", "--seq_len", "64", "--steps", "1", "--eval_steps", "1")),
])
def test_an_entry_point_ends_every_rank_with_status_0_and_its_groups_destroyed(script: str, args: tuple,
                                                                           tmp_path: Path) -> None:
    res = launch(script, *args, "--output_dir", str(tmp_path / "run"), num=2, tmp_path=tmp_path, probe=True)
    assert clean_exit_failures(res, ranks=2) == []
    json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])  # the summary, last
