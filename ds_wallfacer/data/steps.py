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
from typing import Sequence

from .balance import segment_work

__all__ = ["balanced_order", "check_rounds", "idle_share", "round_balance", "row_work"]


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
