"""Work-balanced steps: which rows go into each round of micro-batches so every data-parallel replica gets about
the same attention work (pure integer math, no torch).

A round is one micro-batch per replica (``replicas`` x ``per_replica`` rows). Replicas meet at every round: ZeRO
reduces the gradients of each micro-batch, so the slowest replica sets the pace. With packed documents a row's
attention work is the sum of its documents' squares, and rows of one epoch differ by 2-4x; in arrival order the
busiest replica of a round does 1.5-2.5x the mean work (``bench_steps.py``).

``balanced_order`` reorders an epoch's rows: within each window of rounds (default: the whole epoch) rows are
sorted by work, cut into rounds of neighbours, each round's rows dealt to replicas largest first onto the least
loaded one, and the rounds shuffled (seeded), so the order of steps stays random. Rows are not cut or repacked:
every row, and every document in it, trains exactly as before, once per epoch; only which rows meet in a round
changes. The order is a function of the work list and the seed, so a resumed run replays it exactly.

Design: Note [Work-balanced steps] in docs/design/documents.md.
"""
from __future__ import annotations

import random
from typing import NamedTuple, Sequence

from .balance import segment_work

__all__ = ["FILLER", "Slot", "balanced_order", "check_rounds", "dynamic_rounds", "idle_share", "rank_slots",
           "round_balance", "round_seconds", "row_work"]


def row_work(doc_lengths: Sequence[int], *, window: int | None = None) -> int:
    """Attention work of one packed row: score entries of its documents under a causal (optionally windowed)
    mask."""
    return sum(segment_work(0, length, window=window) for length in doc_lengths)


def check_rounds(work: Sequence[int], per_replica: int, replicas: int, window: int | None) -> int:
    """Rows per round, after checking the sizes, the window and every work (a clear error for each)."""
    if per_replica < 1 or replicas < 1:
        raise ValueError(f"per_replica = {per_replica} and replicas = {replicas} must be positive")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window = {window!r} is invalid: give a positive number of rounds, or None for the epoch")
    for w in work:
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"row work {w!r} is invalid: works are non-negative integers")
    return per_replica * replicas


def _deal(rows: list[int], work: Sequence[int], per_replica: int, replicas: int) -> list[int]:
    """One round's rows -> the same rows laid out replica by replica (``per_replica`` each), the largest first
    onto the replica with the least work that has room (ties: lower replica)."""
    slots: list[list[int]] = [[] for _ in range(replicas)]
    load = [0] * replicas
    for r in sorted(rows, key=lambda i: (-work[i], i)):
        d = min((d for d in range(replicas) if len(slots[d]) < per_replica), key=lambda d: (load[d], d))
        slots[d].append(r)
        load[d] += work[r]
    return [r for s in slots for r in s]


def balanced_order(
    work: Sequence[int], *, per_replica: int, replicas: int, seed: int, window: int | None = None
) -> list[int]:
    """Rows ``0 .. len(work) - 1`` (``work[i]``: row i's attention work) -> an order of the first
    ``len(work) // (per_replica x replicas)`` rounds' worth of them in which round k is positions
    ``k x per_round .. (k + 1) x per_round - 1``, replica d's rows at ``d x per_replica ..`` inside it.

    Rows are taken in the given order, ``window`` rounds at a time (None: all), sorted by work and cut into rounds
    of neighbours; the rounds of a window are shuffled with ``seed``. Rows past the last whole round are left out,
    as an epoch of whole rounds leaves them."""
    per_round = check_rounds(work, per_replica, replicas, window)
    end = len(work) // per_round * per_round
    span = end if window is None else window * per_round
    rng = random.Random(seed)
    order: list[int] = []
    for lo in range(0, end, max(span, 1)):
        rows = sorted(range(lo, min(lo + span, end)), key=lambda i: (work[i], i))
        rounds = [_deal(rows[a : a + per_round], work, per_replica, replicas) for a in range(0, len(rows), per_round)]
        rng.shuffle(rounds)
        order.extend(r for rnd in rounds for r in rnd)
    return order


def _loads(work: Sequence[int], order: Sequence[int], per_replica: int, replicas: int) -> list[list[int]]:
    """Per round of ``order``, each replica's work."""
    per_round = check_rounds(work, per_replica, replicas, None)
    return [[sum(work[r] for r in order[a + d * per_replica : a + (d + 1) * per_replica]) for d in range(replicas)]
            for a in range(0, len(order) // per_round * per_round, per_round)]


def round_balance(work: Sequence[int], order: Sequence[int], *, per_replica: int, replicas: int) -> list[float]:
    """Per round of ``order``: the busiest replica's work over the mean replica's (1.0 = even; a round with no
    work counts as even)."""
    return [max(x) * replicas / sum(x) if sum(x) else 1.0 for x in _loads(work, order, per_replica, replicas)]


def idle_share(work: Sequence[int], order: Sequence[int], *, per_replica: int, replicas: int) -> float:
    """The share of the replicas' attention time spent waiting over the whole ``order``, if time is work: every
    round lasts as long as its busiest replica, sum over rounds of (D x busiest - total) / (D x busiest)."""
    loads = _loads(work, order, per_replica, replicas)
    span = sum(max(x) * replicas for x in loads)
    return (span - sum(sum(x) for x in loads)) / span if span else 0.0


# -- dynamic sequence parallelism: rows of several group sizes in one round ----------------------------------------
FILLER = -1
"""The row of a slot no row of the step took: a minimal sequence with no labels (its gradient is exactly zero), run
so that every rank takes part in every round (ZeRO's collectives span the world)."""


class Slot(NamedTuple):
    """One row on one group in one round: ranks ``first .. first + size - 1``."""

    row: int
    """Index into the step's rows, or ``FILLER``."""
    first: int
    size: int


def _aligned_blocks(lo: int, hi: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Ranks ``lo .. hi - 1`` as (first, size) blocks, each of the largest size in ``sizes`` that starts aligned
    (first % size == 0) and fits."""
    out = []
    while lo < hi:
        size = max(s for s in sizes if lo % s == 0 and lo + s <= hi)
        out.append((lo, size))
        lo += size
    return out


def dynamic_rounds(group_sizes: Sequence[int], seconds: Sequence[float], *, world_size: int, sp_size: int,
                   sizes: Sequence[int]) -> list[list[Slot]]:
    """A step's rows (row i runs on ``group_sizes[i]`` ranks for ``seconds[i]``) -> rounds, each a tiling of the
    world's ranks by aligned groups inside the sequence-parallel blocks of ``sp_size`` ranks.

    Rows are taken longest first and each goes into the first round with a free aligned block of its size (a
    round's rows then take similar times: the round lasts as long as its longest). Ranks no row took run a
    ``FILLER`` alone. Pure and deterministic: every rank computes the same rounds. ``sizes``: the group sizes the
    run built (1 included; each divides the next)."""
    if world_size % sp_size:
        raise ValueError(f"sequence_parallel_size {sp_size} does not divide the world size {world_size}")
    if 1 not in sizes or any(b % a for a, b in zip(sorted(sizes), sorted(sizes)[1:])) or max(sizes) != sp_size:
        raise ValueError(f"group sizes {list(sizes)} must include 1 and P = {sp_size}, each dividing the next")
    for i, p in enumerate(group_sizes):
        if p not in sizes:
            raise ValueError(f"row {i}: group size {p} is not one of {list(sizes)}")
    rounds: list[list[Slot]] = []
    free: list[list[tuple[int, int]]] = []  # per round: free (first, size) blocks, ascending
    for i in sorted(range(len(group_sizes)), key=lambda i: (-seconds[i], -group_sizes[i], i)):
        p = group_sizes[i]
        for r, blocks in enumerate(free):
            fit = [b for b in blocks if b[1] >= p]
            if fit:
                break
        else:
            rounds.append([])
            free.append([(d * sp_size, sp_size) for d in range(world_size // sp_size)])
            r, blocks = len(rounds) - 1, free[-1]
            fit = blocks
        first, size = min(fit, key=lambda b: (b[1], b[0]))  # the tightest block: big ones stay whole
        blocks.remove((first, size))
        blocks.extend(_aligned_blocks(first + p, first + size, sizes))
        blocks.sort()
        rounds[r].append(Slot(i, first, p))
    for slots, blocks in zip(rounds, free):
        slots.extend(Slot(FILLER, first + k, 1) for first, size in blocks for k in range(size))
        slots.sort(key=lambda s: s.first)
    return rounds


def rank_slots(rounds: Sequence[Sequence[Slot]], rank: int) -> list[Slot]:
    """The slot of ``rank`` in each round."""
    return [next(s for s in slots if s.first <= rank < s.first + s.size) for slots in rounds]


def round_seconds(rounds: Sequence[Sequence[Slot]], seconds: Sequence[float], *, filler_s: float = 0.0) -> list[float]:
    """Each round's length if every group runs its row's ``seconds`` (fillers ``filler_s``): its longest slot."""
    return [max(seconds[s.row] if s.row != FILLER else filler_s for s in slots) for slots in rounds]
