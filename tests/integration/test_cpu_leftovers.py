"""What DeepSpeed's CPU backend leaves behind does not pile up: Note [Stale JIT build lock] (a lock left in torch's
extensions directory by a killed run is removed before ``deepspeed.init_distributed``, which would wait on it
forever; a fresh one, a build in progress, is kept) and Note [DeepSpeed's CPU shared-memory buffers] (each rank's
/dev/shm segment is unlinked once every rank has mapped it)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed


def test_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_wallfacer.integration.ds_runtime import _clear_stale_build_lock

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    _clear_stale_build_lock()
    assert lock.exists(), "a fresh lock belongs to a build in progress"
    old = lock.stat().st_mtime - 3600
    os.utime(lock, (old, old))
    monkeypatch.setenv("LOCAL_RANK", "1")
    _clear_stale_build_lock()
    assert lock.exists(), "only local rank 0 clears it"
    monkeypatch.setenv("LOCAL_RANK", "0")
    _clear_stale_build_lock()
    assert not lock.exists()


def _segments_after_init(rank: int, world: int) -> list[str]:
    import datetime

    from ds_wallfacer.integration.ds_runtime import init_distributed

    init_distributed(datetime.timedelta(seconds=60))
    port = os.environ["MASTER_PORT"]
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_shared_memory_segments_are_released_after_init() -> None:
    for world in (1, 2):  # one rank creates a segment too
        left = run_distributed(_segments_after_init, world, timeout_s=180)
        assert left == [[]] * world, left


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_segments_of_a_killed_job_are_swept_and_live_ones_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank killed before every rank mapped the segments leaves them: a later start-up removes this user's that
    no process maps and that are over a minute old; a fresh one (a job starting now) and a mapped one stay."""
    import signal
    import subprocess
    import sys
    import time

    from ds_wallfacer.integration.ds_runtime import sweep_stale_shm_segments

    monkeypatch.setenv("LOCAL_RANK", "0")
    shm = Path("/dev/shm")
    names = {k: f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.9_{os.getpid()}_{k}" for k in ("dead", "fresh",
                                                                                                "mapped", "killed")}
    old = time.time() - 3600
    for k, name in names.items():
        (shm / name).write_bytes(b"\0" * 4096)
        if k != "fresh":
            os.utime(shm / name, (old, old))
    holders = {k: subprocess.Popen([sys.executable, "-c", (
        "import mmap, sys, time; f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 4096); print(1, flush=True);"
        " time.sleep(600)"), str(shm / names[k])], stdout=subprocess.PIPE) for k in ("mapped", "killed")}
    try:
        for p in holders.values():
            assert p.stdout.readline().strip() == b"1"  # mapped
        holders["killed"].send_signal(signal.SIGKILL)  # a rank killed with the segment mapped
        holders["killed"].wait(timeout=30)
        removed = sweep_stale_shm_segments()
        assert names["dead"] in removed and names["killed"] in removed, removed
        assert (shm / names["fresh"]).exists() and (shm / names["mapped"]).exists()
        assert not (shm / names["dead"]).exists() and not (shm / names["killed"]).exists()
    finally:
        for p in holders.values():
            p.kill()
            p.wait(timeout=30)
        for name in names.values():
            (shm / name).unlink(missing_ok=True)
