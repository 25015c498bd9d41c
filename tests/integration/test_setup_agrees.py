"""Every rank must run the layout rank 0 runs: "auto" plans from each host's measured speeds, so two hosts could
choose differently; ``initialize`` refuses that on every rank before any group is built. 2 gloo ranks."""
from __future__ import annotations

from tests.dist_utils import run_distributed


def _check(rank: int, world: int) -> list:
    import torch

    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.integration.setup import check_setup_agrees
    from ds_wallfacer.planner.auto import ParallelSetup

    same = ParallelSetup(ParallelDims(world_size=world, sp_size=world, mode="wallfacer", ring_count=1, num_heads=4,
                                      num_kv_heads=4))
    mode = "ulysses" if rank == 1 else "wallfacer"
    other = ParallelSetup(ParallelDims(world_size=world, sp_size=world, mode=mode, ulysses_degree=world if rank == 1
                                       else 1, ring_count=1, num_heads=4, num_kv_heads=4))
    out = []
    for setup in (same, other):
        try:
            check_setup_agrees(setup, torch.device("cpu"))
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    return out


def test_ranks_that_chose_another_layout_are_refused_on_every_rank() -> None:
    for rank, (same, other) in enumerate(run_distributed(_check, 2, timeout_s=120)):
        assert same is None, (rank, same)
        assert other is not None and "ranks [1] chose another parallel layout than rank 0" in other, (rank, other)
        assert "DS_WALLFACER_CACHE_DIR" in other and '"wallfacer" section' in other, (rank, other)
