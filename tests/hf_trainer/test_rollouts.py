"""Rollouts split over a sequence-parallel group (``hf_trainer/rollouts.py``): the prompts' shares, the seeds, and the
gather that puts the group's completions back in the prompts' order (3 gloo ranks, one without rows)."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.hf_trainer.rollouts import generation_seed, prompt_share, seeded_generation
from tests.dist_utils import run_distributed


@pytest.mark.parametrize("count,parts", [(16, 4), (6, 4), (2, 4), (0, 3), (7, 1), (5, 5)])
def test_shares_are_contiguous_and_differ_by_at_most_one(count: int, parts: int) -> None:
    shares = [prompt_share(count, parts=parts, index=i) for i in range(parts)]
    assert shares[0][0] == 0 and shares[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(shares, shares[1:])), shares
    sizes = [b - a for a, b in shares]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes


def test_share_refuses_a_part_outside_the_group() -> None:
    with pytest.raises(ValueError, match="part 4 of 4"):
        prompt_share(8, parts=4, index=4)


def test_seeds_differ_by_rank_follow_the_shared_state_and_leave_it_as_it_was() -> None:
    torch.manual_seed(3)
    state = torch.random.get_rng_state()
    seeds = [generation_seed(state, index=i) for i in range(4)]
    assert seeds == [seeds[0] + i for i in range(4)] and torch.equal(torch.random.get_rng_state(), state)
    assert generation_seed(state, index=0) == seeds[0]  # reproducible from the shared state
    torch.manual_seed(4)
    assert generation_seed(torch.random.get_rng_state(), index=0) != seeds[0]
    before = torch.random.get_rng_state()
    with seeded_generation(seeds[1], device=None):
        drawn = torch.rand(3)
    assert torch.equal(torch.random.get_rng_state(), before)
    with seeded_generation(seeds[1], device=None):
        assert torch.equal(torch.rand(3), drawn)


def _gather(rank: int, world: int) -> list:
    import torch.distributed as dist

    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.hf_trainer.rollouts import gather_rows

    rows = [list(range(10 * n, 10 * n + length)) for n in range(7) for length in [n % 3]]  # lengths 0, 1, 2, 0, ...
    start, stop = prompt_share(2, parts=world, index=rank)  # 2 rows over 3 ranks: the last has none
    ids = gather_rows(rows[start:stop], max_rows=1, comm=CommLayer(device="cpu"), group=dist.group.WORLD)
    start, stop = prompt_share(len(rows), parts=world, index=rank)
    logps = [[v / 7 for v in r] for r in rows]
    got = gather_rows(logps[start:stop], max_rows=3, comm=CommLayer(device="cpu"), group=dist.group.WORLD,
                      dtype=torch.float64)
    return [ids == rows[:2], got == logps]


def test_gather_puts_the_rows_back_in_order_on_every_rank() -> None:
    assert run_distributed(_gather, 3, timeout_s=60) == [[True, True]] * 3
