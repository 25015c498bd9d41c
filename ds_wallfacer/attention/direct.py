"""The direct-fetch runtime of WallFacer attention (``fetch.FetchSchedule``; Note [Direct fetch] in ``fetch.py``): each
rank computes its own rows against its own shard and against exactly the k/v rows it fetches from their owners, and
sends the dk/dv of those rows back to them. Queries, outputs and dq never leave their rank. Shapes as in
``wallfacer.py``; k and v travel together as one tensor [B, hk, n, d + dv].
"""
from __future__ import annotations

import torch

from .accumulate import land_call_grads, land_call_out, member_accumulators, member_plans, slot_fill
from .calls import call_backward, call_forward, expand_grads
from .fetch import LOOKAHEAD, FetchSchedule
from .sinks import add_sink
from .team import split_kv

__all__ = ["direct_backward", "direct_forward"]


def _rows(x: torch.Tensor, ranges) -> torch.Tensor:
    """Positions ``ranges`` of [B, h, S, D] along S, as one contiguous tensor."""
    if len(ranges) == 1:
        a, b = ranges[0]
        return x[:, :, a:b].contiguous()
    return torch.cat([x[:, :, a:b] for a, b in ranges], dim=2)


class _Fetches:
    """The k/v fetches of the steps 1..P-1, issued in step order ``LOOKAHEAD`` steps ahead of the one computed, and
    with ``budget`` further ahead while the rows in flight fit it; each step's exchange sends this rank's rows to the
    rank that fetches them and receives the rows it fetches."""

    def __init__(self, attn, sched: FetchSchedule, own_kv: torch.Tensor, budget: int = 0) -> None:
        self.attn, self.sched, self.own, self.budget = attn, sched, own_kv, budget
        self.pending: dict[int, object] = {}
        self.issued = 0

    def _issue(self, s: int) -> None:
        sched, ranks = self.sched, self.attn.groups.layout.ranks
        send, src = sched.sends.get(s), sched.sources.get(s)
        sends = [(_rows(self.own, send.ranges), ranks[send.index])] if send else []
        recvs = []
        if src:
            b, h, _, width = self.own.shape
            recvs = [(torch.empty((b, h, src.size, width), dtype=self.own.dtype, device=self.own.device),
                      ranks[src.index])]
        if sends or recvs:
            self.pending[s] = self.attn.comm.exchange(sends, recvs, kind="fetch", group=self.attn.groups.sp_group)

    def ahead(self, upto: int) -> None:
        """Issue every step up to ``upto`` (at most P - 1) not issued yet, then more while the received rows in flight
        stay within the budget."""
        last, sources = self.sched.sp_size - 1, self.sched.sources
        in_flight = lambda: sum(sources[s].size for s in self.pending if s in sources)  # noqa: E731
        while self.issued < last and (self.issued < upto or in_flight() + (
                sources[self.issued + 1].size if self.issued + 1 in sources else 0) <= self.budget):
            self.issued += 1
            self._issue(self.issued)

    def take(self, s: int) -> torch.Tensor | None:
        """Step s's fetched rows (waited for), or None when this rank fetches nothing at step s; sends complete."""
        p = self.pending.pop(s, None)
        if p is None:
            return None
        got = p.wait()
        return got[0] if s in self.sched.sources else None


def _steps(attn, sched: FetchSchedule, own_kv: torch.Tensor, d: int, on_block, before=None) -> None:
    """Walk the blocks in the fixed order (own shard, then steps 1..P-1, fetches in flight ahead); ``on_block(s,
    calls, k, v)`` computes a block's calls (s = 0: the own shard); ``before(s)`` runs at every step s >= 1 on every
    rank, whether or not it fetches then, before the step's block (Note [Direct fetch]: the same place in the order
    on every rank). Without ``before`` (the forward: only fetches travel) a rank also fetches further ahead while
    two shards' worth of rows are in flight at most."""
    fetches = _Fetches(attn, sched, own_kv, budget=0 if before is not None else 2 * own_kv.shape[2])
    fetches.ahead(LOOKAHEAD)
    k_own, v_own = split_kv(own_kv, d)
    on_block(0, sched.own, k_own, v_own)
    for s in range(1, sched.sp_size):
        fetches.ahead(s + LOOKAHEAD)
        if before is not None:
            before(s)
        kv = fetches.take(s)
        if kv is not None:
            on_block(s, sched.sources[s].calls, *split_kv(kv, d))


def direct_forward(attn, kernel, sched: FetchSchedule, q, k, v, sinks, scale: float, opts):
    """(out [B, hq, S_l, dv], lse [B, hq, S_l]) of this rank's rows, with the sinks folded in."""
    b, hq, sl, d = q.shape
    calls = sched.calls
    (plan,), slots = member_plans(calls, "qs", 1, b, sl)
    acc_out = member_accumulators((1, b, hq, sl, v.shape[-1]), q.device, [plan])[0]
    acc_lse = member_accumulators((1, b, hq, sl), q.device, [plan], fill=float("-inf"))[0]
    done = [0]

    def block(s, block_calls, k_b, v_b) -> None:
        for call in block_calls:
            out, lse = call_forward(kernel, call, q[call.rows, :, call.qs], k_b[call.rows, :, call.ks],
                                    v_b[call.rows, :, call.ks], scale=scale, window=opts.window, softcap=opts.softcap)
            land_call_out(acc_out, acc_lse, call, out, lse, slot_fill(plan, slots[done[0]]))
            done[0] += 1
            attn.work["forward"] += call.work
            attn.comm.computed()

    _steps(attn, sched, torch.cat([k, v], dim=-1), d, block)
    if sinks is not None:
        acc_out, acc_lse = add_sink(acc_out, acc_lse, sinks)
    return acc_out.to(q.dtype), acc_lse


def direct_backward(attn, kernel, sched: FetchSchedule, dout, q, k, v, out, lse, scale: float, opts):
    """dq, dk, dv of this rank's shards: the k/v rows fetched again, their dk/dv sent back to their owners after each
    step (``fetch_grad``), and the dk/dv this rank's rows got from the others summed in fp32 in step order."""
    b, hq, sl, d = q.shape
    wire = attn.wire_dtypes(q.dtype)["dkv_home"]
    ranks, comm, group = attn.groups.layout.ranks, attn.comm, attn.groups.sp_group
    expand = expand_grads(kernel, q, k)
    delta_path = callable(getattr(kernel, "backward_delta", None))
    o_own = (dout.float() * out.float()).sum(-1) if delta_path else out
    calls = sched.calls
    (dq_plan,), dq_slots = member_plans(calls, "qs", 1, b, sl)
    dq_acc = member_accumulators((1, b, hq, sl, d), q.device, [dq_plan])[0]
    own_kv = torch.cat([k, v], dim=-1)
    back, done, dkv_own = [], [0], [None]

    def block(s, block_calls, k_b, v_b) -> None:
        (kv_plan,), kv_slots = member_plans(list(block_calls), "ks", 1, b, k_b.shape[2])
        dkv = member_accumulators((1, *k_b.shape[:3], own_kv.shape[-1]), q.device, [kv_plan])[0]
        dk_acc, dv_acc = split_kv(dkv, d)
        for j, call in enumerate(block_calls):
            rows, qs, ks = call.rows, call.qs, call.ks
            grads = call_backward(
                kernel, call, expand, dout[rows, :, qs], q[rows, :, qs], k_b[rows, :, ks], v_b[rows, :, ks],
                None if delta_path else o_own[rows, :, qs], lse[rows, :, qs],
                delta=o_own[rows, :, qs] if delta_path else None, scale=scale, window=opts.window,
                softcap=opts.softcap,
            )
            land_call_grads(dq_acc, dk_acc, dv_acc, call, grads, slot_fill(dq_plan, dq_slots[done[0]]),
                            slot_fill(kv_plan, kv_slots[j]))
            done[0] += 1
            attn.work["backward"] += call.work
            comm.computed()
        if s == 0:
            dkv_own[0] = dkv
        else:  # the fetched rows' dk/dv back to their owner now; the owner sums them at the end
            src = sched.sources[s]
            back.append(comm.exchange([(dkv.to(wire), ranks[src.index])], [], kind="fetch_grad", group=group))

    def served(s: int) -> None:  # post the receive of the dk/dv of the rows the rank of step s fetched from here
        if s in sched.sends:
            send = sched.sends[s]
            buf = torch.empty((b, k.shape[1], send.size, own_kv.shape[-1]), dtype=wire, device=q.device)
            returns.append((s, comm.exchange([], [(buf, ranks[send.index])], kind="fetch_grad", group=group)))

    returns: list = []
    _steps(attn, sched, own_kv, d, block, before=served)
    dkv = dkv_own[0]
    for s, pending in returns:
        got = pending.wait()[0]
        at = 0
        for a, z in sched.sends[s].ranges:
            dkv[:, :, a:z] += got[:, :, at:at + z - a]
            at += z - a
    for pending in back:
        pending.wait()
    dk_own, dv_own = split_kv(dkv, d)
    return dq_acc.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)
