"""Rollouts split over a sequence-parallel group (``hf_trainer/rollouts.py``): the prompts' shares, the seeds, and the
gather that puts the group's completions back in the prompts' order (3 gloo ranks, one without rows). The pieces of
custom rollouts (``hf_trainer/custom_rollouts.py``): a ``rollout_func``'s shares merged in order (pure), and in the
same launch the comm layer's object gather, a standalone tool run once on the group's first rank, and the check
that the group's ranks made the same rows."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.hf_trainer.custom_rollouts import merge_shares, rollout_share
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
    return [ids == rows[:2], got == logps, *_custom_pieces(rank)]


def _custom_pieces(rank: int) -> list:
    """Rank r's object (r + 1 items) gathered; a standalone tool run on rank 0 only, its result and its exception's
    message on every rank; the rows check passing on equal rows and raising on rank 2's other ones."""
    import torch.distributed as dist

    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.hf_trainer.custom_rollouts import (RolloutMismatch, SharedTool, SharedToolError,
                                                         check_same_rows)

    comm, group = CommLayer(device="cpu"), dist.group.WORLD
    objects = comm.all_gather_object({"rank": rank, "items": ["x"] * (rank + 1)}, group)
    calls: list[int] = []

    def tool(n: int) -> int:
        calls.append(n)
        if n < 0:
            raise ValueError(f"negative {n}")
        return n * 2

    faults: list[str] = []
    shared = SharedTool(tool, row=0, comm=comm, group=group, first=rank == 0, faults=faults)
    answer = shared(n=21)
    try:
        shared(n=-1)
        error = None
    except SharedToolError as e:
        error = str(e)
    check_same_rows(([[1, 2]], [[3]]), comm=comm, group=group, sources="The tools", trainer="T")
    try:
        check_same_rows(([[1, 2]], [[3 + (rank == 2)]]), comm=comm, group=group, sources="The tools", trainer="T")
        mismatch = ""
    except RolloutMismatch as e:
        mismatch = str(e)
    return [objects == [{"rank": r, "items": ["x"] * (r + 1)} for r in range(3)], answer, error, calls, faults,
            "ranks [2]" in mismatch and "The tools" in mismatch]


def test_gather_puts_the_rows_back_in_order_on_every_rank() -> None:
    got = run_distributed(_gather, 3, timeout_s=60)
    for rank, values in enumerate(got):
        assert values == [True, True, True, "42", "negative -1", [21, -1] if rank == 0 else [], [], True], (rank,
                                                                                                           values)


def test_rollout_shares_merge_in_the_prompts_order() -> None:
    """Each rank's output for its prompts (a dropped extra row cut) -> the rows concatenated in rank order, shared
    values kept; a list that is not one item per prompt, or a shared value that differs, is refused."""
    shares = [rollout_share({"prompt_ids": [[1], [2]], "completion_ids": [[3], [4]], "logprobs": None,
                             "env_mask": [[1], [0]], "tag": "t"}, rows=2, keep=2),
              rollout_share({"prompt_ids": [[5]], "completion_ids": [[6]], "logprobs": None, "env_mask": [[1]],
                             "tag": "t"}, rows=1, keep=0)]  # a rank without prompts: its dropped row
    assert merge_shares(shares) == {"prompt_ids": [[1], [2]], "completion_ids": [[3], [4]], "logprobs": None,
                                    "env_mask": [[1], [0]], "tag": "t"}
    with pytest.raises(ValueError, match="3 items in 'env_mask' for 2 prompts"):
        rollout_share({"prompt_ids": [[1], [2]], "completion_ids": [[3], [4]], "logprobs": None,
                       "env_mask": [[1], [0], [1]]}, rows=2, keep=2)
    with pytest.raises(ValueError, match="must return keys"):
        rollout_share({"prompt_ids": [[1]]}, rows=1, keep=1)
    other = rollout_share({"prompt_ids": [[5]], "completion_ids": [[6]], "logprobs": None, "env_mask": [[1]],
                           "tag": "u"}, rows=1, keep=1)
    with pytest.raises(ValueError, match="another 'tag' on rank 1"):
        merge_shares([shares[0], other])
