"""WallFacer multi-ring sequence-parallel attention; C = 1 is plain ring attention.

``WallFacerAttention`` is called like a kernel on this rank's shards. The kernel calls of every ring step are
planned in ``schedule.py``, how their results land in the fp32 accumulators in ``accumulate.py``.

Dimensions: B batch, hq / hk query / kv heads, d head dim of q and k, dv of v and the output (d except under
multi-head latent attention), P ranks, C ring count (team size), G = P / C^2 ring steps, S_l = N / P tokens per rank
(two chunks of L = S_l / 2); tensors are [B, h, S, d], a team's or a k/v block's C member shards stacked
[C, B, h, S_l, d]. k and v travel together as one tensor [B, hk, S, d + dv] (k's columns, then v's): one message
per exchange, each at its own size. Note [Pipelined team exchanges] below says how the team's shards flow.

Design: docs/design/attention.md (forward, backward, costs; Note [Bytes as implemented]) and the in-code notes below.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from ..comm import CommLayer, WallFacerGroups
from ..data.chunks import SHARDINGS
from .accumulate import land_call_grads, land_call_out, member_accumulators, member_plans, slot_fill
from .calls import call_backward, call_forward, expand_grads
from .checks import check_inputs_agree, local_error
from .direct import direct_backward, direct_forward
from .documents import SequenceBatch
from .fetch import FetchSchedule, prefer_fetch
from .kernels import BlockKernel, get_kernel
from .kernels.value_dim import with_value_dim
from .merge import merge_
from .blocks import KernelCall
from .schedule import RingSchedule
from .sinks import add_sink, sink_grad, sink_lse
from .team import (Arrivals, RingBlocks, SendMarks, gather_kv, gather_team, local_block, pack, pass_dkv, send_home,
                   send_rows, split_kv, unpack)
from .volume import DEFAULT_SUM_DTYPES, AttnShape, SumDtypes

__all__ = ["WallFacerAttention", "wallfacer_attention"]


@dataclass(eq=False)
class WallFacerAttention:
    """WallFacer attention over the sequence-parallel group in ``groups``; call it like a kernel:
    ``attn(q, k, v, causal=True)`` with this rank's shards in the layout of ``sharding``."""

    groups: WallFacerGroups
    comm: CommLayer = field(default_factory=CommLayer)
    kernel: str | BlockKernel = "auto"
    """Block kernel backend name (``kernels.KERNELS``), "auto", or a kernel object (a backend outside the
    registry, e.g. one with ``backward_delta``)."""
    sharding: str = "zigzag"
    """How the sequence was split across ranks ("zigzag" balances causal work)."""
    accum_comm_dtype: SumDtypes | torch.dtype | None = DEFAULT_SUM_DTYPES
    """dtype on the wire of the partial outputs and gradients summed across ranks: per tensor (``SumDtypes``;
    the default is measured, Note [Summed tensors on the wire]), one dtype for all, or None: the input dtype.
    Sums on a rank are fp32 whatever this says."""
    keep_team_q: bool = False
    """Keep the team's gathered q [C, B, hq, S_l, d] from the forward for the backward instead of gathering it
    again: (C-1) * B*hq*S_l*d elements fewer sent per rank and call, C x the local q held per layer from its forward
    to its backward (for every layer at once unless activation checkpointing recomputes the attention). Off by
    default: with hq = 4 hk and C = 4 that is 4 layer inputs' worth of q per layer."""
    check_inputs: bool = True
    """Validate shapes and dtypes across ranks (one small all-gather per new input signature)."""
    work: Counter = field(default_factory=Counter)
    """Attention score entries computed per batch and head, by phase."""
    _checked: set = field(default_factory=set, repr=False)
    _kernels: dict = field(default_factory=dict, repr=False)
    _schedules: dict = field(default_factory=dict, repr=False)
    """Ring schedules of the current batch (every layer shares them), by (causal, window, shape)."""

    @property
    def sum_dtypes(self) -> SumDtypes:
        """``accum_comm_dtype`` per summed tensor (what ``volume.wallfacer_bytes`` takes)."""
        a = self.accum_comm_dtype
        if isinstance(a, SumDtypes):
            return a
        return SumDtypes.uniform("input" if a is None else str(a).removeprefix("torch."))

    def wire_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """The torch dtype of each summed tensor (``SumDtypes`` field names) for inputs of ``dtype``."""
        sums = self.sum_dtypes
        return {name: dtype if (v := getattr(sums, name)) == "input" else getattr(torch, v)
                for name in ("out", "dq", "dkv_ring", "dkv_home")}

    @property
    def ring_count(self) -> int:
        """C: concurrent sub-rings (team size); ``wallfacer.ring_count`` of the config."""
        return self.groups.layout.ring_count

    @property
    def ring_steps(self) -> int:
        """G = R / C^2: ring steps per call (the sub-ring length)."""
        return self.groups.layout.group_size

    def block_kernel(self, q: torch.Tensor, *, mask: bool = False, softcap: bool = False,
                     value_dim: bool = False) -> BlockKernel:
        """The block kernel for q's device and dtype and what the layer needs (a window mask, soft-capping, a v
        head dim unlike q's), chosen once per combination."""
        if not isinstance(self.kernel, str):  # padded locally if it needs one head dim (``kernels/value_dim.py``)
            return with_value_dim(self.kernel) if value_dim else self.kernel
        key = (q.device.type, q.dtype, mask, softcap, value_dim)
        if key not in self._kernels:
            self._kernels[key] = get_kernel(self.kernel, q, mask=mask, softcap=softcap, value_dim=value_dim)
        return self._kernels[key]

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.sharding!r}; expected one of {SHARDINGS}")

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
        batch: "SequenceBatch | None" = None, window: int | None = None, softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``batch``: the documents and chunk assignment of a packed batch (None: one document per row, the
        layout's sharding); ``window``: the layer's sliding window (None: full); ``softcap``: logit soft-capping;
        ``sinks``: one sink logit per query head [hq] (``sinks.py``), or None. q, k [B, h, S_l, d]; v [B, hk, S_l,
        dv] -> out [B, hq, S_l, dv]."""
        if self.check_inputs:
            self._check(q, k, v, causal)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        opts = _Options(batch=batch, window=window, softcap=float(softcap or 0.0))
        return _WallFacerFn.apply(q, k, v, sinks, self, causal, scale, opts)

    # -- validation ------------------------------------------------------------------------------
    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        check_inputs_agree(q, k, v, causal=causal, error=local_error(q, k, v), who="WallFacer attention",
                           comm=self.comm, group=self.groups.sp_group, checked=self._checked)


def wallfacer_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: WallFacerAttention, *, causal: bool = True,
    scale: float | None = None, **options,
) -> torch.Tensor:
    """Functional form of ``attn(q, k, v, causal=..., scale=..., batch=..., window=..., softcap=...)``."""
    return attn(q, k, v, causal=causal, scale=scale, **options)


# -- layout helpers --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Options:
    """The keyword options of one call (``WallFacerAttention.__call__``)."""

    batch: SequenceBatch | None
    window: int | None
    softcap: float


def _schedule(attn: WallFacerAttention, kernel: BlockKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              causal: bool, opts: _Options) -> RingSchedule | FetchSchedule:
    """The schedule of this call, planned once per batch and shape: every layer of a batch shares it. A packed or
    windowed batch runs the direct fetch (``fetch.prefer_fetch``), any other the ring / teams."""
    batch = opts.batch or SequenceBatch()
    b, s_local = q.shape[0], q.shape[2]
    key = (causal, opts.window, b, s_local, k.shape[1], v.shape[-1], q.dtype, id(batch))
    cache = attn._schedules
    if key in cache and cache[key][0] is batch:
        return cache[key][1]
    if any(k[-1] != id(batch) for k in cache):
        cache.clear()  # a new batch: the previous batch's schedules are not needed again
    layout, index = attn.groups.layout, attn.groups.place.index
    plan = dict(sharding=attn.sharding, causal=causal, batch=batch, window=opts.window)
    shape = AttnShape(b, s_local * layout.ring_size, q.shape[1], k.shape[1], q.shape[-1], q.element_size(),
                      v.shape[-1])
    if prefer_fetch(layout, **plan, local_len=s_local, shape=shape, sums=attn.sum_dtypes, q_kept=attn.keep_team_q,
                    gather_out=not callable(getattr(kernel, "backward_delta", None))):
        sched = FetchSchedule.plan(layout, index, **plan, rows=b, local_len=s_local)
    else:
        sched = RingSchedule.plan(layout, index, **plan, rows=b, local_len=s_local)
    cache[key] = (batch, sched)
    return sched


def _block(x: torch.Tensor, call: KernelCall, which: slice) -> torch.Tensor:
    return x[call.rows, :, which]


# -- forward / backward ----------------------------------------------------------------------------

# Note [Pipelined team exchanges]: a team's C members each hold a shard of its query rows, and the k/v block a rank
# holds at a ring step is made of C member shards too. Every kernel call is planned per pair (query member a, key
# member b) with slices inside the two shards (``KernelCall.qm`` / ``km``; ``block_calls`` on the members' own chunk
# lists, which are identical or disjoint), so nothing is ever permuted into a team-wide order, and a call needs
# exactly two shards. At step 0 those arrive one round each: the skewed k/v gather in C rounds (round r: the member
# of local index r of every team sends its shard to the C lanes that start with its team) and the team's q in C - 1
# rounds (round r: to member local - r, from member local + r), all issued at once; a call waits only for its two
# (``team.Arrivals``), and the next ring hop starts once the whole block is here. ``schedule.pipeline_order`` puts
# the pairs in arrival order, starting with this rank's own rows against the first k/v piece (one wait at most),
# and in the last step finishes the other members' rows first, member local + 1 first: its partial (out, lse)
# (forward) or dq (backward) is sent to it while this rank computes the rest, and each rank merges what it receives
# for its own rows in a fixed order (log-sum-exp for out, fp32 sums for dq). The backward's dk/dv go home a member's
# slice at a time, after the dq sends, each as soon as the calls on its keys are done. Every rank issues all of
# these exchanges in the same order (the rounds, the ring hop, the sends of finished rows, the home rounds): they
# pair up whether they overlap or each completes before it returns (``CommLayer.serial``), and the order of
# operations on a communicator is the same on every rank, as NCCL requires. What stays exposed is what has nothing
# before it or after it: the first k/v piece on a rank whose first block is another team's (local != 0), and the
# last home round (``tests/comm/test_overlap.py``). Bytes: ``volume.wallfacer_bytes``; the team's lse is not
# all-gathered (each partial output carries its own), so the forward sends (C-1)*(C-1)*n_l*4 fewer bytes.
#
# Note [Summed tensors on the wire]: every sum on a rank is fp32 (block outputs merged by log-sum-exp; dq and the
# dk/dv of a block summed over the block's calls, query heads and ring steps). What is rounded is what crosses
# the wire: the partial outputs (forward, each member's rows sent to it), the dq partials (backward, likewise),
# the dk/dv accumulators passed along the sub-ring, and each lane's final dk/dv slice sent home.
# ``WallFacerAttention.accum_comm_dtype`` chooses each (``volume.SumDtypes``). The defaults were measured: bf16
# inputs, 8/2 heads, causal zigzag, max abs error against float64 as a multiple of the same kernel's error on the
# full sequence in one process (``benchmarks/bench_precision.py``); a tensor travels in the input dtype where that
# stays within 2x, in fp32 where it does not. A partial output is normalised by its own lse before it is rounded,
# so it is bounded by the output's scale, and the receiver weights it by exp(lse - lse_row) <= 1; dq partials and
# home slices are rounded once each and summed once; only the ring accumulator is a running sum rounded again at
# every hop, so its error grows with the ring length G and it stays fp32.
#
# Note [Gradients of grouped heads]: with hq > hk a kernel's dk/dv of one call is a sum over the hq/hk query heads
# of each kv head. Kernels that return the input dtype round that sum (flash-attn 2, cuDNN and CUDA SDPA round each
# head's share first, then the sum; PyTorch's CPU flash op loses more than one rounding too), and a block's dk/dv
# is a sum of P/C such calls, so bf16 dk/dv erred up to 1.74x the single-process kernel's here (2.0-2.35x in
# earlier measurements). Block calls of a multi-block backward therefore get k/v expanded to the query heads and
# the heads are summed in fp32 here, rounding once at the end. It costs the expanded k/v of one call (and 1.5x the
# CPU op's backward time: it is GQA-native); a kernel that sums heads in fp32 itself says so with
# ``reduces_heads_in_fp32 = True``. dq cannot be helped this way: a kernel rounds each block's dq to the input
# dtype, as every ring implementation built on such kernels does.
#
# Note [Backward without out]: a block kernel's backward uses out only through delta = rowsum(dO * out), one fp32
# number per query row. A kernel whose backward takes delta (``backward_delta(dout, q, k, v, delta, lse, *,
# causal, scale, mask=None, softcap=0.0)``, the ``backward`` contract with delta [B, hq, Sq] fp32 for out) lets the
# team all-gather carry delta instead of out: (C-1) * B*hq*S_l*4 bytes instead of (C-1) * B*hq*S_l*d*s, each rank
# forming delta for its own rows from its own dO and out. None of the registered backends can: PyTorch's CPU
# flash op, its CUDA flash / memory-efficient / cuDNN backward ops and flash-attn 2/3/4 all take out and compute
# delta in their own preprocessing kernel; the reference kernel computes it inline and could take it. Kernels
# that need out keep getting it.


def _forward(attn, kernel: BlockKernel, sched: RingSchedule, q, k, v, sinks, scale: float, opts: _Options):
    """(out [B, hq, S_l, dv], lse [B, hq, S_l] of this rank's rows, and the team's q [C, B, hq, S_l, d] with
    ``keep_team_q``); with ``sinks`` both already include them (folded in once, after all blocks: Note [Attention
    sinks], docs/design/attention.md)."""
    grp, comm, place = attn.groups, attn.comm, attn.groups.place
    c, p, me = grp.layout.ring_count, grp.layout.ring_size, place.local
    b, hq, sl, d = q.shape
    dv = v.shape[-1]
    wire = attn.wire_dtypes(q.dtype)

    if p == 1:  # one rank: no collective; the kernel itself when one call covers everything
        call = sched.only_call(sl, b)
        if call is not None:
            attn.work["forward"] += call.work
            out, lse = kernel.forward(q, k, v, causal=call.causal, scale=scale, softcap=opts.softcap)
            return (out, lse) if sinks is None else add_sink(out, lse, sinks)
        cur, first = local_block(k, v)
        team_q, q_buf = Arrivals([q], [None]), None
    else:
        # 1-2. the skewed k/v gather and the team's q, one round per member, all in flight (team.py)
        cur, first = gather_kv(attn, k, v)
        q_buf = torch.empty((c, *q.shape), dtype=q.dtype, device=q.device) if attn.keep_team_q else None
        team_q = gather_team(attn, q.contiguous(), out=q_buf)
    # 3. ring steps; each call waits only for its own two shards; results land in fp32 accumulators per member
    calls = [call for step in sched.steps for call in step]
    plans, slots = member_plans(calls, "qs", c, b, sl)
    acc_out = member_accumulators((c, b, hq, sl, dv), q.device, plans)
    acc_lse = member_accumulators((c, b, hq, sl), q.device, plans, fill=float("-inf"))
    ring = RingBlocks(attn, cur, first, len(sched.steps))
    sends = []

    def send(t: int) -> None:  # member local + t's rows are final: its partial output and lse go to it
        m = (me + t) % c
        sends.append(send_rows(attn, t, pack([acc_out[m].to(wire["out"]), acc_lse[m]])))

    i = 0
    for s, step in enumerate(sched.steps):
        ring.begin(s)
        marks = SendMarks(sched.sends_after if s == len(sched.steps) - 1 else (), send)
        for j, call in enumerate(step):
            q_m = team_q.get(call.qm)
            k_b, v_b = split_kv(ring.block(call.km), d)
            out, lse = call_forward(kernel, call, _block(q_m, call, call.qs), _block(k_b, call, call.ks),
                                    _block(v_b, call, call.ks), scale=scale, window=opts.window, softcap=opts.softcap)
            m = call.qm
            land_call_out(acc_out[m], acc_lse[m], call, out, lse, slot_fill(plans[m], slots[i]))
            i += 1
            attn.work["forward"] += call.work
            comm.computed()
            marks(j + 1)
        ring.end()
    team_q.wait_all()
    # 4. the other members' partial (out, lse) of this rank's rows, merged by log-sum-exp in a fixed order
    out, lse = acc_out[me], acc_lse[me]
    for pending in sends:
        got_out, got_lse = unpack(pending.wait()[0], [(out.shape, wire["out"]), (lse.shape, torch.float32)])
        merge_(out, lse, got_out, got_lse)
    if sinks is not None:  # the sink joins each row's normaliser once
        new = sink_lse(lse, sinks)
        out.mul_(torch.exp(lse - new).unsqueeze(-1))
        lse = new
    out = out.to(q.dtype)
    return (out, lse, q_buf) if attn.keep_team_q and c > 1 else (out, lse)


def _backward_inputs(attn, q, k, v, dout, out, lse, *, q_team: torch.Tensor | None, delta_path: bool):
    """Steps 1-2 of the backward: the skewed k/v gather again, and the team's rows in one message per member: q
    (unless kept), dO (the adjoint of the forward's sends), out, or only the fp32 delta = rowsum(dO * out) for a
    kernel that takes it (``delta_path``), and lse. Returns (k/v block, its first arrival, the team's rows)."""
    o_own = (dout.float() * out.float()).sum(-1) if delta_path else out
    if attn.groups.layout.ring_size == 1:
        cur, first = local_block(k, v)
        return cur, first, Arrivals([(q, dout, o_own, lse)], [None])
    cur, first = gather_kv(attn, k, v)
    own = ([] if q_team is not None else [q]) + [dout, o_own, lse]
    like = [(x.shape, x.dtype) for x in own]

    def rows_of(flat: torch.Tensor):
        got = unpack(flat, like)
        return tuple(got) if q_team is None else (None, *got)

    return cur, first, gather_team(attn, pack(own), unpack_fn=rows_of)


def _sum_backward(dq, homes, sends, home_sends, q, k, v):
    """Step 4: sum the lanes' dk/dv of this rank's shard (``homes`` [C, B, hk, S_l, d + dv]) and the other members'
    dq of its rows onto its own (``dq``), in fp32 in a fixed order; cast to the inputs' dtypes."""
    for pending in home_sends:
        pending.wait()
    dkv_own = homes.sum(dim=0, dtype=torch.float32)  # [B, hk, S_l, d + dv]
    for pending in sends:
        dq += pending.wait()[0]
    dk_own, dv_own = split_kv(dkv_own, q.shape[-1])
    return dq.to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)


def _backward(
    attn, kernel: BlockKernel, sched: RingSchedule, dout, q, k, v, out, lse, scale: float, opts: _Options,
    q_team: torch.Tensor | None = None,
):
    """dq, dk, dv; ``q_team``: the team's q kept from the forward (``keep_team_q``), else gathered again. out and
    lse (this rank's rows) include the sinks, if any: then this is the backward with them (Note [Attention sinks],
    docs/design/attention.md)."""
    grp, comm, place = attn.groups, attn.comm, attn.groups.place
    c, p, me = grp.layout.ring_count, grp.layout.ring_size, place.local
    b, hq, sl, d = q.shape
    wire = attn.wire_dtypes(q.dtype)
    call = sched.only_call(sl, b) if p == 1 else None
    if call is not None:  # one rank: exactly the kernel on the whole sequence
        attn.work["backward"] += call.work
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, causal=call.causal, scale=scale, softcap=opts.softcap)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    delta_path = p > 1 and callable(getattr(kernel, "backward_delta", None))
    cur, first, team = _backward_inputs(attn, q, k, v, dout, out, lse, q_team=q_team, delta_path=delta_path)
    # 3. ring: k/v move ahead; dk/dv of the held block follow one step behind, then go home
    expand = expand_grads(kernel, q, k)
    calls = [call for step in sched.steps for call in step]
    dq_plans, dq_slots = member_plans(calls, "qs", c, b, sl)
    dq_acc = member_accumulators((c, b, hq, sl, d), q.device, dq_plans)
    ring = RingBlocks(attn, cur, first, len(sched.steps))
    sends, home_sends, dkv_pending = [], [], None
    homes = torch.empty(cur.shape, dtype=wire["dkv_home"], device=q.device)  # [C, B, hk, S_l, d + dv]: the lanes'

    def send(t: int) -> None:
        """The last step's sends in their fixed order: t < C, member local + t's dq; then home round t - C."""
        if t < c:
            sends.append(send_rows(attn, t, dq_acc[(me + t) % c].to(wire["dq"])))
            return
        m = t - c
        if dkv_pending is not None:  # the sub-ring's sum so far of this slice (sent after the previous step)
            if not dkv_pending.done:
                dkv_pending.wait()
            dkv[m] += dkv_pending.recvs[0][m]
        home_sends.append(send_home(attn, sched, m, dkv[m].to(wire["dkv_home"]), homes))

    last = len(sched.steps) - 1
    i = 0
    for s, step in enumerate(sched.steps):
        ring.begin(s)
        kv_plans, kv_slots = member_plans(step, "ks", c, b, sl)
        dkv = member_accumulators(cur.shape, q.device, kv_plans)  # [C, B, hk, S_l, d + dv]
        # the last step: the dq sends, then each member's slice of dk/dv home once the calls on its keys are done
        marks = SendMarks(sched.sends_after + sched.home_after if s == last else (), send)
        for j, call in enumerate(step):
            q_m, do_m, o_m, lse_m = team.get(call.qm)
            if q_team is not None:
                q_m = q_team[call.qm]
            k_b, v_b = split_kv(ring.block(call.km), d)
            qs, ks, rows = call.qs, call.ks, call.rows
            grads = call_backward(
                kernel, call, expand, do_m[rows, :, qs], q_m[rows, :, qs], k_b[rows, :, ks], v_b[rows, :, ks],
                None if delta_path else o_m[rows, :, qs], lse_m[rows, :, qs],
                delta=o_m[rows, :, qs] if delta_path else None, scale=scale, window=opts.window, softcap=opts.softcap,
            )
            land_call_grads(dq_acc[call.qm], *split_kv(dkv[call.km], d), call, grads,
                            slot_fill(dq_plans[call.qm], dq_slots[i]), slot_fill(kv_plans[call.km], kv_slots[j]))
            i += 1
            attn.work["backward"] += call.work
            comm.computed()
            marks(j + 1)
        ring.end()
        if p == 1:  # one step, nothing to send or receive
            dk_own, dv_own = split_kv(dkv[0], d)
            return dq_acc[0].to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)
        if s < last:
            if dkv_pending is not None:
                dkv += dkv_pending.wait()[0]
            dkv_pending = pass_dkv(attn, dkv, wire)
    team.wait_all()
    return _sum_backward(dq_acc[me], homes, sends, home_sends, q, k, v)


class _WallFacerFn(torch.autograd.Function):
    """The autograd node of one WallFacer call. Inside a checkpointed layer (``residuals.py``) the first forward
    keeps (out, lse, and the team's q with ``keep_team_q``) and the recompute returns them: no block kernel, no
    collective, nothing counted twice; q, k, v come from the layer's recompute either way (the same values)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, attn: WallFacerAttention, causal: bool, scale: float, opts: _Options):
        from .residuals import residual_slot, tensor_key

        kernel = attn.block_kernel(q, mask=opts.window is not None, softcap=bool(opts.softcap),
                                   value_dim=v.shape[-1] != q.shape[-1])
        sched = _schedule(attn, kernel, q, k, v, causal, opts)
        run = direct_forward if isinstance(sched, FetchSchedule) else _forward
        has_sinks = sinks is not None
        slot = residual_slot("wallfacer", attn, tensor_key(q, k, v, *([sinks] if has_sinks else [])), causal, scale,
                             opts)
        if slot is not None and slot.replaying:
            out, lse, *kept = slot.take()
        else:
            with torch.no_grad(), attn.comm.phase("forward"):
                out, lse, *kept = run(attn, kernel, sched, q, k, v, sinks, scale, opts)
            if slot is not None:
                slot.keep(out, lse, *kept)
        # kept: the team's q (``keep_team_q``)
        ctx.save_for_backward(q, k, v, out, lse, *([sinks] if has_sinks else []), *kept)
        ctx.attn, ctx.kernel, ctx.sched, ctx.scale, ctx.opts, ctx.slot = attn, kernel, sched, scale, opts, slot
        ctx.has_sinks = has_sinks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, *rest = ctx.saved_tensors
        sinks, kept = (rest[0], rest[1:]) if ctx.has_sinks else (None, rest)
        attn = ctx.attn
        dout = dout.to(q.dtype)
        with torch.no_grad(), attn.comm.phase("backward"):
            run = direct_backward if isinstance(ctx.sched, FetchSchedule) else _backward
            dq, dk, dv = run(attn, ctx.kernel, ctx.sched, dout, q, k, v, out, lse, ctx.scale, ctx.opts, *kept)
            # the sink's gradient over this rank's own rows (Note [Attention sinks], docs/design/attention.md)
            dsinks = None if sinks is None else sink_grad(dout, out, lse, sinks)
        if ctx.slot is not None:
            ctx.slot.done()
        return dq, dk, dv, dsinks, None, None, None, None
