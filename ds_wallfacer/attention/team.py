"""The exchanges of WallFacer attention: the C members' shards arriving one by one, point to point, so that the
kernel calls on the shards already here run while the rest are in flight (``Arrivals``, Note [Pipelined team
exchanges] in ``wallfacer.py``); the k/v blocks of the ring steps (``RingBlocks``); the sends of finished rows in
their fixed order (``SendMarks``, ``send_rows``); the dk/dv passed along the sub-ring and sent home (``pass_dkv``,
``send_home``).

Every exchange here is a round that all ranks issue in the same order (the skewed k/v gather in C rounds, the
team's all-gather and the sends of finished rows in C - 1 rounds each), so the rounds pair up whether the comm
layer overlaps them or completes each one before it returns (``CommLayer.serial``). Shapes as in ``wallfacer.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..comm import Pending
from .schedule import RingSchedule

__all__ = [
    "Arrivals", "RingBlocks", "SendMarks", "gather_kv", "gather_team", "local_block", "pack", "pass_dkv", "send_home",
    "send_rows", "split_kv", "unpack",
]


@dataclass(eq=False)
class Arrivals:
    """Per member, its tensors: this rank's own at hand, the others behind a pending round each, waited on (once)
    the first time they are asked for."""

    items: list
    pending: list[Pending | None]
    unpack: list = field(default_factory=list)
    """Per member: a function of the received buffer giving its tensors (None: the buffer is the item)."""
    sends: list[Pending] = field(default_factory=list)
    """Rounds that only send (their received piece is this rank's own, copied when issued): waited by ``wait_all``."""

    def get(self, member: int):
        p = self.pending[member]
        if p is not None:
            self.pending[member] = None
            buf = p.wait()[0]
            fn = self.unpack[member] if self.unpack else None
            self.items[member] = buf if fn is None else fn(buf)
        return self.items[member]

    @property
    def complete(self) -> bool:
        return all(p is None for p in self.pending)

    def wait_all(self) -> None:
        for m in range(len(self.pending)):
            self.get(m)
        for p in self.sends:
            p.wait()
        self.sends = []


def gather_kv(attn, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Arrivals]:
    """The skewed gather of this rank's first k/v block [C, B, hk, S_l, d + dv], in C rounds: in round r the member
    of local index r of every team sends its own shard to the C ranks (one per lane) whose first block is its team,
    and every rank receives member r of its block. Returns the block's buffer and its arrivals (member b's piece is
    ``buf[b]``; a piece that is this rank's own is copied, not sent)."""
    place, c = attn.groups.place, attn.groups.layout.ring_count
    own = torch.cat([k, v], dim=-1)  # [B, hk, S_l, d + dv]
    buf = torch.empty((c, *own.shape), dtype=own.dtype, device=own.device)
    pending: list[Pending | None] = []
    only_sends = []
    for r in range(c):
        sends = [(own, dst) for dst in place.kv_dests] if place.local == r else []
        p = attn.comm.exchange(sends, [(buf[r], place.kv_sources[r])], kind="skew", group=attn.groups.sp_group)
        if place.kv_sources[r] == place.rank:  # the piece is at hand already: no need to wait before using it
            only_sends.append(p)
            p = None
        pending.append(p)
    return buf, Arrivals(list(buf), pending, sends=only_sends)


def gather_team(attn, own: torch.Tensor, *, out: torch.Tensor | None = None, unpack_fn=None) -> Arrivals:
    """The team's all-gather of ``own`` in C - 1 rounds: in round r this rank sends ``own`` to member local - r and
    receives member local + r's. ``out``: a [C, *own.shape] buffer to receive into (own copied in at ``local``);
    ``unpack_fn``: applied to each member's buffer when it arrives and to ``own`` (a packed message)."""
    place, c = attn.groups.place, attn.groups.layout.ring_count
    me, team = place.local, place.team_ranks
    items: list = [None] * c
    pending: list[Pending | None] = [None] * c
    if out is not None:
        out[me].copy_(own)
    items[me] = own if unpack_fn is None else unpack_fn(own)
    for r in range(1, c):
        src = (me + r) % c
        recv = out[src] if out is not None else torch.empty_like(own)
        pending[src] = attn.comm.exchange([(own, team[(me - r) % c])], [(recv, team[src])], kind="all_gather",
                                          group=attn.groups.sp_group)
    return Arrivals(items, pending, [unpack_fn] * c if unpack_fn is not None else [])


def send_rows(attn, t: int, message: torch.Tensor) -> Pending:
    """Round t (1..C-1) of the sends of finished rows: ``message`` (the rows of member local + t) goes to that
    member, and member local - t's message for this rank's rows arrives (same size)."""
    place, c = attn.groups.place, attn.groups.layout.ring_count
    me, team = place.local, place.team_ranks
    recv = torch.empty_like(message)
    return attn.comm.exchange([(message, team[(me + t) % c])], [(recv, team[(me - t) % c])], kind="reduce_scatter",
                              group=attn.groups.sp_group)


def pack(xs: list[torch.Tensor]) -> torch.Tensor:
    """Tensors of any dtypes as one flat byte tensor (one message)."""
    return torch.cat([x.contiguous().view(-1).view(torch.uint8) for x in xs])


def unpack(flat: torch.Tensor, like: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Inverse of ``pack``: views of ``flat`` with the shapes and dtypes of ``like``."""
    out, at = [], 0
    for shape, dtype in like:
        n = dtype.itemsize * torch.Size(shape).numel()
        piece = flat[at:at + n]
        if at % dtype.itemsize:  # not aligned for a view as ``dtype``
            piece = piece.clone()
        out.append(piece.view(dtype).view(shape))
        at += n
    return out


def split_kv(kv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d + dv] -> the k [..., d] and v [..., dv] views."""
    return kv[..., :d], kv[..., d:]


def local_block(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, Arrivals]:
    """One rank's k/v block [1, B, hk, S_l, d + dv] (no gather)."""
    cur = torch.cat([k, v], dim=-1).unsqueeze(0)
    return cur, Arrivals([cur[0]], [None])


class RingBlocks:
    """The k/v blocks of the ring steps: step 0's arrives member by member (``team.gather_kv``), each later one
    whole from the previous rank; the next block is sent on as soon as the held one is complete."""

    def __init__(self, attn, cur: torch.Tensor, first: Arrivals, steps: int) -> None:
        self.attn, self.cur, self.first, self.steps = attn, cur, first, steps
        self.step, self.next = 0, None

    def _start_next(self) -> None:
        if self.next is None and self.step + 1 < self.steps and self.first.complete:
            place = self.attn.groups.place
            nxt = torch.empty_like(self.cur)
            self.next = self.attn.comm.exchange([(self.cur, place.ring_next)], [(nxt, place.ring_prev)], kind="ring",
                                                group=self.attn.groups.sp_group)

    def begin(self, step: int) -> None:
        self.step = step
        self._start_next()

    def block(self, member: int) -> torch.Tensor:
        """Member ``member``'s shard [B, hk, S_l, d + dv] of the held block (waited for if it is still coming)."""
        if self.step > 0:
            return self.cur[member]
        x = self.first.get(member)
        self._start_next()
        return x

    def end(self) -> None:
        """After the step's calls: the held block complete, the next one received."""
        if self.step == 0:
            self.first.wait_all()
            self._start_next()
        if self.next is not None:
            self.cur, self.next = self.next.wait()[0], None


class SendMarks:
    """Sends in a fixed order: ``fire(t)`` for t = 1..len(after) once ``after[t - 1]`` calls of the step are done
    and every earlier one has fired (every rank issues them in the same order: Note [Pipelined team exchanges])."""

    def __init__(self, after: tuple[int, ...], fire) -> None:
        self.after, self.fire, self.t = after, fire, 0
        self(0)

    def __call__(self, done: int) -> None:
        while self.t < len(self.after) and self.after[self.t] <= done:
            self.t += 1
            self.fire(self.t)


def pass_dkv(attn, dkv: torch.Tensor, wire: dict[str, torch.dtype]):
    """Send the held block's dk/dv [C, B, hk, S_l, d + dv] one hop along the sub-ring. Returns the pending exchange."""
    place = attn.groups.place
    send = dkv.to(wire["dkv_ring"])
    recv = torch.empty_like(send)
    return attn.comm.exchange([(send, place.ring_next)], [(recv, place.ring_prev)], kind="ring",
                              group=attn.groups.sp_group)


def send_home(attn, sched: RingSchedule, m: int, slice_m: torch.Tensor, homes: torch.Tensor):
    """Home round m after the last step: member m's dk/dv slice of the held block goes to member m of the block's
    team (``sched.home[0][m]``); a rank of team position m receives its shard's slice from each of the C lanes into
    ``homes`` [C, B, hk, S_l, d + dv]."""
    dests, sources = sched.home
    recvs = list(zip(homes, sources)) if attn.groups.place.local == m else []
    return attn.comm.exchange([(slice_m, dests[m])], recvs, kind="skew", group=attn.groups.sp_group)
