"""The watchdog on gloo ranks in-process: slow but healthy ranks (steps 2.5 times the timeout, spent inside a
collective) never trigger it; every rank reads every peer's heartbeat and where it runs; a clean stop leaves
every rank "done"."""
from __future__ import annotations

import time

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
