"""Rollouts split over a sequence-parallel group: each rank generates its share of the group's prompts, and the
group all-gathers the completions so that every rank holds the whole batch, in the prompts' order.

The P ranks of a group train on one batch (``replicas.py``), so one rank's generation of it would do; generating it
on all P (what a group did before) costs P times the work and the KV-cache memory a rank needs. Here rank i of the
group generates prompts ``prompt_share(n, parts=P, index=i)`` (contiguous slices whose sizes differ by at most one)
and ``gather_rows`` puts the group's results back together in rank order, which is the prompts' order.

Seeding (Note [Seeds of a split rollout]): before each rollout the ranks of a group share one random state (its first
rank's; ``rl.py``). Rank i samples its share from generators seeded with ``s + i``, where ``s`` is the first draw of
62 bits from a copy of that shared CPU generator (``generation_seed``); when its generation ends, the CPU generator,
and the device's, are back where they were. So sampling ranks draw different numbers, a run is reproducible from its
seed, and the draws after the rollout (TRL's shuffle of the round into micro-batches) are the same on every rank of the
group. Greedy decoding draws nothing: the split then equals one process generating the whole batch.

Here: the shares (``prompt_share``, pure), the seeds (``generation_seed``, ``seeded_generation``) and the gather;
the trainer's wiring is ``rl.py``'s.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from ..comm.ops import CommLayer

__all__ = ["gather_rows", "generation_seed", "prompt_share", "seeded_generation"]

_SEED_BITS = 62
"""Bits of the group's draw: ``s + i`` stays below torch's seed limit (2**64) for any group size."""


def prompt_share(count: int, *, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of part ``index`` when ``count`` prompts are cut into ``parts`` contiguous slices, sizes
    differing by at most one (the first ``count % parts`` parts one longer); empty when ``count < parts`` and
    ``index >= count``."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"prompt_share: part {index} of {parts} parts; need 0 <= index < parts")
    if count < 0:
        raise ValueError(f"prompt_share: {count} prompts; need count >= 0")
    base, extra = divmod(count, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def generation_seed(state: torch.Tensor, *, index: int) -> int:
    """The seed rank ``index`` of a group samples its share with: ``s + index``, ``s`` the first 62-bit draw of a CPU
    generator in ``state`` (the group's shared ``torch.random.get_rng_state()``; the global generator is not
    advanced). Note [Seeds of a split rollout] in the module docstring."""
    g = torch.Generator()
    g.set_state(state)
    s = int(torch.randint(0, 2**_SEED_BITS, (1,), generator=g, dtype=torch.int64))
    return s + index


@contextlib.contextmanager
def seeded_generation(seed: int, *, device: torch.device | None) -> Iterator[None]:
    """Inside: the CPU generator and, where ``device`` is a CUDA device, that device's generator seeded with
    ``seed`` (sampling on a GPU draws from the device's); after: both as they were before."""
    cuda = device is not None and device.type == "cuda"
    with torch.random.fork_rng(devices=[device] if cuda else []):
        torch.random.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)  # this device only (torch.manual_seed would reseed every device)
        yield


def gather_rows(rows: Sequence[Sequence[float]], *, max_rows: int, comm: CommLayer, group: dist.ProcessGroup,
                dtype: torch.dtype = torch.int64) -> list[list]:
    """Each rank's rows of varying length (at most ``max_rows`` of them) -> every rank's rows, in group-rank order,
    on every rank of ``group``: one all-gather of the rows' lengths, one of their values (``dtype``: int64 for
    token ids, float64 for log-probabilities, both exact)."""
    if len(rows) > max_rows:
        raise ValueError(f"gather_rows: {len(rows)} rows, more than max_rows {max_rows}")
    lengths = torch.full((max_rows,), -1, dtype=torch.int64)  # -1: no row
    lengths[: len(rows)] = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    with comm.phase("data"):
        every = comm.all_gather(comm.place(lengths), group).cpu()  # [P, max_rows]
        width = max(int(every.clamp(min=0).sum(dim=1).max()), 1)
        flat = torch.zeros(width, dtype=dtype)
        mine = [v for r in rows for v in r]
        flat[: len(mine)] = torch.tensor(mine, dtype=dtype)
        values = comm.all_gather(comm.place(flat), group).cpu()  # [width] -> [P, width]
    out: list[list] = []
    for part, counts in enumerate(every.tolist()):
        start = 0
        for k in (k for k in counts if k >= 0):
            out.append(values[part, start:start + k].tolist())
            start += k
    return out
