"""The team side of WallFacer attention: the C members' shards in team order and back, the skewed k/v
all-gather of a team, and one all-gather for tensors of several dtypes.

A team holds C ranks' shards; in team order its chunks ascend along the sequence (``perm``: the gathered chunks'
positions, from ``schedule.RingSchedule``). Shapes as in ``wallfacer.py``.
"""
from __future__ import annotations

import torch

from ..comm import CommLayer
from .schedule import RingSchedule

__all__ = ["all_gather_packed", "from_team", "gather_kv", "own_rows", "split_kv", "team_kv", "to_team"]


def to_team(g: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """Gathered [C, B, h, S_l, *r] (members in order, m chunks each) -> team order [B, h, S_t, *r] (chunks
    ascending); ``perm`` has C * m entries."""
    c, b, h, s = g.shape[:4]
    rest = g.shape[4:]
    m = len(perm) // c
    if c == 1 and perm == sorted(perm):  # one member, chunks already ascending: a view
        return g[0]
    x = g.reshape(c, b, h, m, s // m, *rest).movedim(0, 2).reshape(b, h, m * c, s // m, *rest)
    return x[:, :, perm].reshape(b, h, c * s, *rest)


def from_team(x: torch.Tensor, perm: list[int], c: int) -> torch.Tensor:
    """Inverse of ``to_team``: [B, h, S_t, *r] -> [C, B, h, S_l, *r]."""
    b, h, st = x.shape[:3]
    rest = x.shape[3:]
    n = len(perm)
    if c == 1 and perm == sorted(perm):
        return x.unsqueeze(0)
    inv = [0] * n
    for i, p in enumerate(perm):
        inv[p] = i
    y = x.reshape(b, h, n, st // n, *rest)[:, :, inv]
    return y.reshape(b, h, c, n // c, st // n, *rest).movedim(2, 0).reshape(c, b, h, st // c, *rest)


def gather_kv(attn, k: torch.Tensor, v: torch.Tensor):
    """Skewed all-gather: start receiving the C shards of this rank's first k/v team straight from its
    members, and sending this rank's own shard to the C ranks (one per lane) whose first team is ours."""
    place = attn.groups.place
    own = torch.cat([k, v], dim=-1)  # [B, hk, S_l, d + dv]
    bufs = torch.empty((len(place.kv_sources), *own.shape), dtype=own.dtype, device=own.device)
    pending = attn.comm.exchange(
        [(own, dst) for dst in place.kv_dests], list(zip(bufs, place.kv_sources)), kind="skew",
        group=attn.groups.sp_group,
    )
    return pending, bufs


def team_kv(bufs: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """[C, B, hk, S_l, d + dv] member shards -> [B, hk, S_t, d + dv] in team order (one copy)."""
    return to_team(bufs, perm)


def split_kv(kv: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., d + dv] -> the k [..., d] and v [..., dv] views."""
    return kv[..., :d], kv[..., d:]


def own_rows(attn, sched: RingSchedule, x: torch.Tensor) -> torch.Tensor:
    """This rank's rows [B, h, S_l] of a team-order row tensor [B, h, S_t] (the team lse)."""
    c = attn.groups.layout.ring_count
    return from_team(x.unsqueeze(-1), sched.perm, c)[attn.groups.place.local].squeeze(-1)


def all_gather_packed(comm: CommLayer, xs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """One all-gather for tensors of any dtypes, packed as bytes: each [*s] -> [C, *s]."""
    flat = torch.cat([x.contiguous().view(-1).view(torch.uint8) for x in xs])
    g = comm.all_gather(flat, group)  # [C, total bytes]
    out, at = [], 0
    for x in xs:
        n = x.numel() * x.element_size()
        out.append(g[:, at:at + n].contiguous().view(x.dtype).view(g.shape[0], *x.shape))
        at += n
    return out
