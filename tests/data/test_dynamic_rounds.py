"""Dynamic sequence parallelism's pure parts: the group sizes a layout offers, the rounds that tile the world, and
the size each row gets. No process group."""
from __future__ import annotations

import random

import pytest

from ds_wallfacer.comm.dims import ParallelDims, dynamic_sizes, sub_dims
from ds_wallfacer.data.steps import FILLER, dynamic_rounds, rank_slots, round_seconds
from ds_wallfacer.planner import Workload, get_cluster, get_model
from ds_wallfacer.planner.dynamic import RowModel, choose_sizes, row_candidates


def test_sizes_keep_the_layout_shape_and_fit_the_heads() -> None:
    d = ParallelDims(16, 8, ulysses_degree=2, ring_count=2, num_heads=8, num_kv_heads=4)
    assert dynamic_sizes(d) == (1, 2, 4, 8)
    assert (sub_dims(d, 4).ulysses_degree, sub_dims(d, 4).ring_count, sub_dims(d, 4).mode) == (2, 1, "hybrid")
    assert (sub_dims(d, 2).mode, sub_dims(d, 1).mode) == ("ulysses", "wallfacer")
    assert sub_dims(ParallelDims(16, 16, ring_count=4), 8).ring_count == 2  # C*C must divide the ring ranks
    # a mixer whose 6 heads only 1, 2 and 6 ranks split: 4 is left out, P stays (validated elsewhere)
    assert dynamic_sizes(ParallelDims(8, 8), whole_heads=(6,)) == (1, 2, 8)
    with pytest.raises(ValueError, match="does not divide"):
        sub_dims(d, 3)


@pytest.mark.parametrize("world,p", [(8, 8), (8, 4), (16, 8), (6, 6)])
def test_rounds_tile_every_rank_once_with_aligned_groups(world: int, p: int) -> None:
    sizes = tuple(s for s in range(1, p + 1) if p % s == 0 and (s & (s - 1) == 0 or s == p))
    rng = random.Random(world * p)
    group = [rng.choice(sizes) for _ in range(23)]
    secs = [g * rng.uniform(0.5, 1.5) for g in group]
    rounds = dynamic_rounds(group, secs, world_size=world, sp_size=p, sizes=sizes)
    assert rounds == dynamic_rounds(group, secs, world_size=world, sp_size=p, sizes=sizes)  # deterministic
    rows = [s.row for r in rounds for s in r if s.row != FILLER]
    assert sorted(rows) == list(range(len(group)))  # every row exactly once
    for slots in rounds:
        covered = sorted(k for s in slots for k in range(s.first, s.first + s.size))
        assert covered == list(range(world))  # every rank in exactly one slot per round
        for s in slots:
            assert s.first % s.size == 0 and s.first // p == (s.first + s.size - 1) // p  # aligned, one P-block
            assert s.row == FILLER and s.size == 1 or s.size == group[s.row]
    assert [len(rank_slots(rounds, r)) for r in range(world)] == [len(rounds)] * world
    assert len(round_seconds(rounds, secs)) == len(rounds)


def test_rows_take_the_smallest_group_that_fits_and_long_rows_spread() -> None:
    model, cluster = get_model("llama3-8b"), get_cluster("h100x64")
    dims = ParallelDims(64, 64, num_heads=model.heads, num_kv_heads=model.kv_heads)
    sizes = dynamic_sizes(dims)
    cands = row_candidates({p: sub_dims(dims, p) for p in sizes}, mini_sequence=True, checkpointing=True)
    rm = RowModel(model=model, cluster=cluster, workload=Workload(seq_len=128, zero_stage=3), candidates=cands)
    assert rm.fits(8192, 1) and not rm.fits(1 << 20, 8)  # the memory model
    lengths = [8192] * 60 + [1 << 20]
    chosen = choose_sizes(lengths, [n * (n + 1) // 2 for n in lengths], model=rm, world_size=64, sp_size=64)
    assert chosen[-1] >= 16 and max(chosen[:-1]) <= 4  # short rows stay small; the 1M row spreads
    capped = RowModel(model=model, cluster=cluster, workload=Workload(seq_len=128), candidates=cands,
                      max_tokens_per_rank=1024)
    assert [p for p in sizes if capped.fits(4096, p)][0] == 4
    with pytest.raises(ValueError, match="more than a group of 64 ranks holds"):
        choose_sizes([1 << 17], [1], model=capped, world_size=64, sp_size=64)
