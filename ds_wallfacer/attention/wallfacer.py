"""WallFacer multi-ring sequence-parallel attention (docs/design.md §2); C = 1 is plain ring attention.

Dimensions: B batch, hq / hk query / kv heads, d head dim, P sequence-parallel ranks, C ring count (team
size), G = P / C^2 ring steps, S_l = N / P tokens per rank (two chunks of L = S_l / 2), S_t = C * S_l
tokens per team. Tensors are [B, h, S, d] (the HF attention layout).

Forward, per call:
 1. all-gather q in the team                                      [B, h, S_l, d] -> [B, h, S_t, d]
 2. skewed gather: member j of team (g, t) receives the k/v of team (g + j, t) straight from its C
    members (point-to-point, overlapping step 1), so no team copy of k/v is ever made
 3. G ring steps: k/v move one hop along the sub-ring (double-buffered, overlapping the block kernel);
    (out, lse) merged into fp32 accumulators by log-sum-exp
 4. all-gather the partial lse in the team, weight the partial outputs, reduce-scatter them (fp32)
Backward rotates k/v with their dk/dv accumulators (not q, dO, dq): with grouped-query attention this moves
hk/hq of the bytes, and it mirrors the forward. After the last step each dk/dv slice goes straight to its
owner (a skewed reduce-scatter). q, k, v, out and dO are re-gathered rather than saved, so a layer keeps
only its own shards (plus the team's fp32 lse) between forward and backward.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import CommLayer, RankLayout, WallFacerGroups
from ..data.chunks import SHARDINGS
from .checks import check_inputs_agree, local_error
from .kernels import BlockKernel, get_kernel
from .schedule import BlockCall, block_calls, call_work, team_chunk_order

__all__ = ["WallFacerAttention", "attention_work", "ring_schedule", "wallfacer_attention"]



@dataclass(eq=False)
class WallFacerAttention:
    """WallFacer attention over the sequence-parallel group in ``groups``; call it like a kernel:
    ``attn(q, k, v, causal=True)`` with this rank's shards in the layout of ``sharding``."""

    groups: WallFacerGroups
    comm: CommLayer = field(default_factory=CommLayer)
    kernel: str = "auto"
    """Block kernel backend name (``kernels.KERNELS``) or "auto"."""
    sharding: str = "zigzag"
    """How the sequence was split across ranks ("zigzag" balances causal work)."""
    accum_comm_dtype: torch.dtype | None = torch.float32
    """dtype of the partial outputs and gradients that are summed across ranks; None: the input dtype."""
    check_inputs: bool = True
    """Validate shapes and dtypes across ranks (one small all-gather per new input signature)."""
    work: Counter = field(default_factory=Counter)
    """Attention score entries computed per batch and head, by phase."""
    _checked: set = field(default_factory=set, repr=False)
    _kernels: dict = field(default_factory=dict, repr=False)

    @property
    def ring_count(self) -> int:
        """C: concurrent sub-rings (team size); ``wallfacer.ring_count`` of the config."""
        return self.groups.layout.ring_count

    @property
    def ring_steps(self) -> int:
        """G = R / C^2: ring steps per call (the sub-ring length)."""
        return self.groups.layout.group_size

    def block_kernel(self, q: torch.Tensor) -> BlockKernel:
        """The block kernel for q's device and dtype, chosen once per (device, dtype)."""
        key = (q.device.type, q.dtype)
        if key not in self._kernels:
            self._kernels[key] = get_kernel(self.kernel, q)
        return self._kernels[key]

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.sharding!r}; expected one of {SHARDINGS}")

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None
    ) -> torch.Tensor:
        if self.check_inputs:
            self._check(q, k, v, causal)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return _WallFacerFn.apply(q, k, v, self, causal, scale)

    # -- validation ------------------------------------------------------------------------------
    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        check_inputs_agree(q, k, v, causal=causal, error=local_error(q, k, v), who="WallFacer attention",
                           comm=self.comm, group=self.groups.sp_group, checked=self._checked)


def wallfacer_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: WallFacerAttention, *, causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """Functional form of ``attn(q, k, v, causal=..., scale=...)``."""
    return attn(q, k, v, causal=causal, scale=scale)


# -- layout helpers --------------------------------------------------------------------------------


def _to_team(g: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """Gathered [C, B, h, S_l, *r] (members in order) -> team order [B, h, S_t, *r] (chunks ascending)."""
    c, b, h, s = g.shape[:4]
    rest = g.shape[4:]
    x = g.reshape(c, b, h, 2, s // 2, *rest).movedim(0, 2).reshape(b, h, 2 * c, s // 2, *rest)
    return x[:, :, perm].reshape(b, h, c * s, *rest)


def _from_team(x: torch.Tensor, perm: list[int], c: int) -> torch.Tensor:
    """Inverse of ``_to_team``: [B, h, S_t, *r] -> [C, B, h, S_l, *r]."""
    b, h, st = x.shape[:3]
    rest = x.shape[3:]
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    y = x.reshape(b, h, 2 * c, st // (2 * c), *rest)[:, :, inv]
    return y.reshape(b, h, c, 2, st // (2 * c), *rest).movedim(2, 0).reshape(c, b, h, st // c, *rest)


def _pack(*xs: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.reshape(-1) for x in xs])


def _unpack(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    out, i = [], 0
    for s in shapes:
        n = s.numel()
        out.append(flat[..., i : i + n].reshape(*flat.shape[:-1], *s))
        i += n
    return out


def _merge(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: (acc_out, acc_lse) <- log-sum-exp combination with a block's (out, lse), in fp32."""
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)  # rows with no key seen yet
    a = torch.exp(acc_lse - safe).unsqueeze(-1)
    b = torch.exp(lse - safe).unsqueeze(-1)
    acc_out.mul_(a).add_(out.float() * b)
    acc_lse.copy_(new)


@dataclass(frozen=True)
class _RingSchedule:
    """Static facts of one call on this rank: chunk orders, peers, block calls per ring step."""

    perm: list[int]
    steps: list[list[BlockCall]]
    chunk_len: int


def ring_schedule(layout: RankLayout, index: int, *, sharding: str, causal: bool) -> tuple[list[int], list[list[BlockCall]]]:
    """Pure: for sequence-parallel rank ``index``, the team-order permutation of its gathered chunks and
    the block-kernel calls of every ring step (the "full / diagonal / skipped" schedule, docs/design.md §2.2)."""
    c, g, p = layout.ring_count, layout.group_size, layout.sp_size
    place = layout.places[index]
    q_chunks, perm = team_chunk_order(range(place.team * c, (place.team + 1) * c), p, sharding)
    kv_group = (place.group + place.local) % c
    steps = []
    for s in range(g):
        kv_team = kv_group * g + (place.pos - s) % g
        k_chunks, _ = team_chunk_order(range(kv_team * c, (kv_team + 1) * c), p, sharding)
        steps.append(block_calls(q_chunks, k_chunks, causal=causal))
    return perm, steps


def attention_work(layout: RankLayout, *, sharding: str, causal: bool, chunk_len: int = 1) -> list[int]:
    """Pure: score entries each rank computes in one forward (per batch and head), by rank index."""
    return [
        sum(call_work(call, chunk_len) for calls in ring_schedule(layout, i, sharding=sharding, causal=causal)[1]
            for call in calls)
        for i in range(layout.sp_size)
    ]


def _schedule(attn: WallFacerAttention, s_local: int, causal: bool) -> _RingSchedule:
    perm, steps = ring_schedule(attn.groups.layout, attn.groups.place.index, sharding=attn.sharding, causal=causal)
    return _RingSchedule(perm=perm, steps=steps, chunk_len=s_local // 2)


def _sl(call: BlockCall, L: int) -> tuple[slice, slice]:
    return slice(call.q_lo * L, call.q_hi * L), slice(call.k_lo * L, call.k_hi * L)


# -- forward / backward ----------------------------------------------------------------------------


def _gather_kv(attn, k: torch.Tensor, v: torch.Tensor):
    """Skewed all-gather: start receiving the C shards of this rank's first k/v team straight from its
    members, and sending this rank's own shard to the C ranks (one per lane) whose first team is ours."""
    place = attn.groups.place
    own = torch.stack([k, v])  # [2, B, hk, S_l, d]
    bufs = torch.empty((len(place.kv_sources), *own.shape), dtype=own.dtype, device=own.device)
    pending = attn.comm.exchange(
        [(own, dst) for dst in place.kv_dests], list(zip(bufs, place.kv_sources)), kind="skew", group=attn.groups.sp_group
    )
    return pending, bufs


def _team_kv(bufs: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """[C, 2, B, hk, S_l, d] member shards -> [2, B, hk, S_t, d] in team order."""
    return torch.stack([_to_team(bufs[:, 0], perm), _to_team(bufs[:, 1], perm)])


def _forward(attn, kernel: BlockKernel, sched: _RingSchedule, q, k, v, causal: bool, scale: float):
    grp, comm, place = attn.groups, attn.comm, attn.groups.place
    c = grp.layout.ring_count
    b, hq, sl, d = q.shape
    acc_dtype = attn.accum_comm_dtype or q.dtype

    # 1-2. skewed gather of k/v (point-to-point, in flight) and team all-gather of q: [B, h, S_l, d] -> [B, h, S_t, d]
    kv_pending, bufs = _gather_kv(attn, k, v)
    q_t = _to_team(comm.all_gather(q, grp.team_group), sched.perm)
    kv_pending.wait()
    cur = _team_kv(bufs, sched.perm)  # [2, B, hk, S_t, d]
    # 3. ring steps, double-buffered
    acc_out = torch.zeros(b, hq, c * sl, d, dtype=torch.float32, device=q.device)
    acc_lse = torch.full((b, hq, c * sl), float("-inf"), dtype=torch.float32, device=q.device)
    L = sched.chunk_len
    for s, calls in enumerate(sched.steps):
        pending = None
        if s + 1 < len(sched.steps):
            nxt = torch.empty_like(cur)
            pending = comm.exchange([(cur, place.ring_next)], [(nxt, place.ring_prev)], kind="ring", group=grp.sp_group)
        for call in calls:
            qs, ks = _sl(call, L)
            out, lse = kernel.forward(q_t[:, :, qs], cur[0][:, :, ks], cur[1][:, :, ks], causal=call.causal, scale=scale)
            _merge(acc_out[:, :, qs], acc_lse[:, :, qs], out, lse)
            attn.work["forward"] += call_work(call, L)
        if pending is not None:
            cur = pending.wait()[0]
    # 4. lse-weighted reduce-scatter in the team: [B, hq, S_t, d] -> [C, B, hq, S_l, d] -> own [B, hq, S_l, d]
    lse_all = comm.all_gather(acc_lse, grp.team_group)  # [C, B, hq, S_t]
    lse_team = torch.logsumexp(lse_all, dim=0)
    weight = torch.exp(acc_lse - lse_team).unsqueeze(-1)
    part = _from_team((acc_out * weight).to(acc_dtype), sched.perm, c)
    out = comm.reduce_scatter(part, grp.team_group).to(q.dtype)
    return out, lse_team


def _backward(attn, kernel: BlockKernel, sched: _RingSchedule, dout, q, k, v, out, lse_team, causal: bool, scale: float):
    grp, comm, place = attn.groups, attn.comm, attn.groups.place
    c = grp.layout.ring_count
    b, hq, sl, d = q.shape
    acc_dtype = attn.accum_comm_dtype or q.dtype
    dout = dout.to(q.dtype)

    # 1-2. skewed gather of k/v again, team all-gather of q, out, dO (dO: adjoint of the forward reduce-scatter)
    kv_pending, bufs = _gather_kv(attn, k, v)
    gathered = _unpack(comm.all_gather(_pack(q, out, dout), grp.team_group), [q.shape, out.shape, dout.shape])
    q_t, o_t, do_t = (_to_team(x, sched.perm) for x in gathered)
    kv_pending.wait()
    cur = _team_kv(bufs, sched.perm)
    # 3. ring: k/v move ahead; dk/dv of the held block follow one step behind, then go home
    dq_acc = torch.zeros(b, hq, c * sl, d, dtype=torch.float32, device=q.device)
    L = sched.chunk_len
    dkv_pending = None
    last = len(sched.steps) - 1
    for s, calls in enumerate(sched.steps):
        kv_pending = None
        if s < last:
            nxt = torch.empty_like(cur)
            kv_pending = comm.exchange([(cur, place.ring_next)], [(nxt, place.ring_prev)], kind="ring", group=grp.sp_group)
        dkv = torch.zeros(cur.shape, dtype=torch.float32, device=q.device)
        for call in calls:
            qs, ks = _sl(call, L)
            dq, dk, dv = kernel.backward(
                do_t[:, :, qs], q_t[:, :, qs], cur[0][:, :, ks], cur[1][:, :, ks], o_t[:, :, qs],
                lse_team[:, :, qs], causal=call.causal, scale=scale,
            )
            dq_acc[:, :, qs] += dq
            dkv[0][:, :, ks] += dk
            dkv[1][:, :, ks] += dv
            attn.work["backward"] += call_work(call, L)
        if dkv_pending is not None:
            dkv += dkv_pending.wait()[0]
        dkv = dkv.to(acc_dtype)
        if s < last:
            recv = torch.empty_like(dkv)
            dkv_pending = comm.exchange([(dkv, place.ring_next)], [(recv, place.ring_prev)], kind="ring", group=grp.sp_group)
        else:  # skewed reduce-scatter: each member of the block's team gets its slice, one per lane
            slices = torch.stack([_from_team(dkv[0], sched.perm, c), _from_team(dkv[1], sched.perm, c)], dim=1)
            homes = torch.empty_like(slices)  # [C, 2, B, hk, S_l, d]
            dkv_pending = comm.exchange(list(zip(slices, place.home_dests)), list(zip(homes, place.home_sources)),
                                        kind="skew", group=grp.sp_group)
        if kv_pending is not None:
            cur = kv_pending.wait()[0]
    # 4. sum the lanes' dk/dv of this rank's shard; reduce-scatter dq in the team (adjoint of the all-gather)
    dkv_own = torch.stack(dkv_pending.wait()).sum(dim=0)  # [2, B, hk, S_l, d]
    dq = comm.reduce_scatter(_from_team(dq_acc.to(acc_dtype), sched.perm, c), grp.team_group)
    return dq.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype)


class _WallFacerFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn: WallFacerAttention, causal: bool, scale: float):
        kernel = attn.block_kernel(q)
        sched = _schedule(attn, q.shape[2], causal)
        with torch.no_grad(), attn.comm.phase("forward"):
            out, lse_team = _forward(attn, kernel, sched, q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse_team)
        ctx.attn, ctx.kernel, ctx.sched, ctx.causal, ctx.scale = attn, kernel, sched, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_team = ctx.saved_tensors
        with torch.no_grad(), ctx.attn.comm.phase("backward"):
            dq, dk, dv = _backward(ctx.attn, ctx.kernel, ctx.sched, dout, q, k, v, out, lse_team, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None
