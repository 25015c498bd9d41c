"""The watchdog on gloo ranks in-process: slow but healthy ranks (steps 2.5 times the timeout, spent inside a
collective) never trigger it, and every rank reads every peer's heartbeat and where it runs; a verdict posted by
one rank ends every rank with one line that names the same rank."""
from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from tests.dist_utils import run_distributed


def _slow_steps(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from ds_wallfacer.train.watchdog import Watchdog

    wd = Watchdog(timeout_s=1, interval_s=0.25, handle_signals=False).start()
    for _ in range(2):
        if rank == 1:
            time.sleep(2.5)  # the others wait in the barrier for longer than the timeout
        dist.barrier()
    seen = {"lost": wd._store_lost, "infos": sorted(wd._infos), "beats": sorted(wd._state)}
    wd.stop()
    return seen


def test_slow_healthy_ranks_do_not_trigger_it() -> None:
    for rank, seen in enumerate(run_distributed(_slow_steps, 3, timeout_s=120)):
        peers = sorted(set(range(3)) - {rank})
        assert seen == {"lost": False, "infos": sorted({0, *peers} - {rank}), "beats": peers}, (rank, seen)


def _posted_verdict(rank: int, world: int, tmp: str) -> str:
    import json
    import os

    import torch.distributed as dist

    from ds_wallfacer.train.watchdog import Watchdog

    fd = os.open(f"{tmp}/rank{rank}.err", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)  # the watchdog's line goes to this rank's file
    wd = Watchdog(timeout_s=30, interval_s=0.25, handle_signals=False).start()
    dist.barrier()
    if rank == 2:  # as a rank that saw a peer on its host vanish would
        wd._store.set("fault", json.dumps({"what": "rank 9 (host h, local rank 1, pid 1) exited", "by": 2}))
    time.sleep(30)  # every rank is ended by the verdict long before
    return "not ended"


def test_a_posted_verdict_ends_every_rank_with_its_names(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match="exited with code 3 and reported nothing"):
        run_distributed(_posted_verdict, 3, str(tmp_path), timeout_s=60)
    for rank in range(3):
        lines = (tmp_path / f"rank{rank}.err").read_text().splitlines()
        said = [line for line in lines if line.startswith("ds_wallfacer watchdog")]
        want = (rf"ds_wallfacer watchdog on rank {rank} \(host \S+, local rank {rank}, pid \d+\): rank 9 \(host h, "
                r"local rank 1, pid 1\) exited \(detected by rank 2\); ending this rank \(exit code 3\)")
        assert len(said) == 1 and re.match(want, said[0]), lines
