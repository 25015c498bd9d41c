"""The fp32 accumulators of WallFacer attention (``wallfacer.py``): a static plan of which ranges of each kernel
call's result are written, added (or merged) or never touched, so that an accumulator is not zero-filled first, and
the landing of each result by that plan.

Note [No zero fills]: an accumulator starts uninitialised, and a static plan of the calls (``fill_plan``)
says which ranges of each call's result are written (first touch) and which are added (or merged), and which
ranges no call touches (zeroed, or set to lse -inf). Calls on single batch rows (packed documents) fall back to
a zero fill.
"""
from __future__ import annotations

import functools

import torch

from .merge import merge_

__all__ = [
    "call_spans", "fill_plan", "fill_untouched", "fresh_accumulator", "land", "land_call_grads", "land_call_out",
    "land_merged", "member_accumulators", "member_plans", "slot_fill",
]


def _gaps(covered: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Parts of [lo, hi) outside the sorted disjoint ``covered`` ranges."""
    out, at = [], lo
    for a, b in covered:
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def _cover(covered: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``covered`` with [lo, hi) added, merged into sorted disjoint ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*covered, (lo, hi)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@functools.lru_cache(maxsize=4096)
def fill_plan(spans: tuple[tuple[int, int, int, int], ...], rows: int, n: int):
    """Note [No zero fills]: for results of calls ``spans`` = (row_lo, row_hi, lo, hi) landing in order in an
    accumulator of ``rows`` batch rows and ``n`` positions, ((writes, adds) per span, untouched ranges); ranges are
    absolute [a, b). None when a span covers only some rows."""
    covered: list[tuple[int, int]] = []
    per_span = []
    for r0, r1, lo, hi in spans:
        if (r0, r1) != (0, rows):
            return None
        writes = _gaps(covered, lo, hi)
        adds = _gaps(writes, lo, hi)
        per_span.append((tuple(writes), tuple(adds)))
        covered = _cover(covered, lo, hi)
    return tuple(per_span), tuple(_gaps(covered, 0, n))


def call_spans(calls, which: str) -> tuple[tuple[int, int, int, int], ...]:
    """(row_lo, row_hi, lo, hi) of each call's query (``which = "qs"``) or key range."""
    return tuple((c.rows.start, c.rows.stop, getattr(c, which).start, getattr(c, which).stop) for c in calls)


def land(acc: torch.Tensor, x: torch.Tensor, lo: int, fill) -> None:
    """Write / add ``x`` (positions [lo, lo + len) along dim 2 of ``acc``) by ``fill`` = (writes, adds)."""
    writes, adds = fill
    for a, b in writes:
        acc[:, :, a:b].copy_(x[:, :, a - lo:b - lo])
    for a, b in adds:
        acc[:, :, a:b].add_(x[:, :, a - lo:b - lo])


def land_merged(
    acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, lo: int, fill
) -> None:
    """``land`` for a block's (out, lse) in the (out, lse) accumulators: written ranges are copied, added ones merged
    by log-sum-exp (``merge.merge_``)."""
    writes, adds = fill
    for a, z in writes:
        acc_out[:, :, a:z].copy_(out[:, :, a - lo:z - lo])
        acc_lse[:, :, a:z].copy_(lse[:, :, a - lo:z - lo])
    for a, z in adds:
        merge_(acc_out[:, :, a:z], acc_lse[:, :, a:z], out[:, :, a - lo:z - lo], lse[:, :, a - lo:z - lo])


def slot_fill(plan, slot: int):
    """The (writes, adds) of a call's result by its member's fill plan, or None (no plan: add / merge it whole)."""
    return None if plan is None else plan[0][slot]


def land_call_out(acc_out: torch.Tensor, acc_lse: torch.Tensor, call, out: torch.Tensor, lse: torch.Tensor,
                  fill) -> None:
    """A kernel call's (out, lse) into a member's accumulators: by ``fill`` (``slot_fill``), or merged whole."""
    if fill is None:
        merge_(acc_out[call.rows, :, call.qs], acc_lse[call.rows, :, call.qs], out, lse)
    else:
        land_merged(acc_out, acc_lse, out, lse, call.qs.start, fill)


def land_call_grads(dq_acc: torch.Tensor, dk_acc: torch.Tensor, dv_acc: torch.Tensor, call, grads, dq_fill,
                    kv_fill) -> None:
    """A kernel call's (dq, dk, dv) into the accumulators of its query rows and of its keys, by their fills
    (``slot_fill``), or added whole."""
    dq, dk, dv = grads
    rows, qs, ks = call.rows, call.qs, call.ks
    if dq_fill is None:
        dq_acc[rows, :, qs] += dq
    else:
        land(dq_acc, dq, qs.start, dq_fill)
    if kv_fill is None:
        dk_acc[rows, :, ks] += dk
        dv_acc[rows, :, ks] += dv
    else:
        land(dk_acc, dk, ks.start, kv_fill)
        land(dv_acc, dv, ks.start, kv_fill)


def fresh_accumulator(shape, device, plan, *, fill: float = 0.0, dim: int = 2) -> torch.Tensor:
    """An fp32 accumulator: uninitialised except the ranges (along ``dim``) ``plan`` leaves untouched, or filled
    with ``fill`` throughout when there is no plan."""
    return fill_untouched(torch.empty(shape, dtype=torch.float32, device=device), plan, fill, dim=dim)


def fill_untouched(acc: torch.Tensor, plan, fill: float = 0.0, *, dim: int = 2) -> torch.Tensor:
    """``acc`` with the ranges (along ``dim``) that ``plan`` leaves untouched set to ``fill``, or all of it when
    there is no plan."""
    if plan is None:
        return acc.fill_(fill)
    for a, b in plan[1]:
        acc.narrow(dim, a, b - a).fill_(fill)
    return acc


def member_plans(calls: list, which: str, members: int, rows: int, n: int):
    """(per member: the fill plan of its calls in order (Note [No zero fills]), per call: its index in its member's
    list); ``which``: "qs" (accumulators of query rows, by ``qm``) or "ks" (of keys, by ``km``)."""
    attr = "qm" if which == "qs" else "km"
    per: list[list] = [[] for _ in range(members)]
    slot = []
    for call in calls:
        m = getattr(call, attr)
        slot.append(len(per[m]))
        per[m].append(call)
    return [fill_plan(call_spans(x, which), rows, n) for x in per], slot


def member_accumulators(shape, device: torch.device, plans, *, fill: float = 0.0) -> torch.Tensor:
    """fp32 accumulators [C, *member shape], member m's set where ``plans[m]`` leaves it untouched."""
    acc = torch.empty(shape, dtype=torch.float32, device=device)
    for m, plan in enumerate(plans):
        fill_untouched(acc[m], plan, fill)
    return acc
