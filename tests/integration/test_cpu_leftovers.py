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
    from ds_wallfacer.integration.deepspeed import _clear_stale_build_lock

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

    from ds_wallfacer.integration.deepspeed import _init_distributed

    _init_distributed(datetime.timedelta(seconds=60))
    port = os.environ["MASTER_PORT"]
    return sorted(p.name for p in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_shared_memory_segments_are_released_after_init() -> None:
    for world in (1, 2):  # one rank creates a segment too
        left = run_distributed(_segments_after_init, world, timeout_s=180)
        assert left == [[]] * world, left
