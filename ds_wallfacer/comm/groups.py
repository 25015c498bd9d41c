"""Process groups for a WallFacer layout, built once and passed explicitly (no module-level state)."""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Sequence

import torch.distributed as dist

from .layout import RankLayout, RankPlace

__all__ = ["WallFacerGroups", "build_groups", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class WallFacerGroups:
    """This rank's view of the layout and the groups it communicates on."""

    layout: RankLayout
    place: RankPlace
    sp_group: dist.ProcessGroup
    """All P ranks of this rank's sequence-parallel group (input checks, point-to-point)."""
    team_group: dist.ProcessGroup
    """This rank's team of C ranks (all-gather / reduce-scatter)."""


def build_groups(
    layouts: Sequence[RankLayout], *, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> WallFacerGroups:
    """Create the groups of every layout (one per sequence-parallel group; all ranks must call this with
    the same list, in the same order) and return this rank's.

    ``dist.new_group`` is collective over the world, so every rank creates every group, members or not.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call deepspeed.init_distributed() first")
    me, world = dist.get_rank(), dist.get_world_size()
    covered = sorted(r for lay in layouts for r in lay.ranks)
    if covered != list(range(world)):
        raise ValueError(
            f"the sequence-parallel groups must cover every rank exactly once; world size is {world}, "
            f"groups cover {covered}"
        )
    mine: WallFacerGroups | None = None
    for lay in layouts:
        sp = _new_group(lay.ranks, timeout)
        teams = [_new_group(team, timeout) for team in lay.teams()]
        if me in lay.ranks:
            place = lay.place_of_rank(me)
            mine = WallFacerGroups(layout=lay, place=place, sp_group=sp, team_group=teams[place.team])
    assert mine is not None
    return mine


def _new_group(ranks: Sequence[int], timeout: datetime.timedelta) -> dist.ProcessGroup:
    return dist.new_group(ranks=list(ranks), timeout=timeout, use_local_synchronization=False)
