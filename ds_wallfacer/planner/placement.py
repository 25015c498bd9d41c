"""Rank placement: which global ranks form each sequence-parallel group, ring and Ulysses group, and which
links every traffic kind crosses.

Which rank plays which part is ``comm.dims.ParallelDims``' (the same arithmetic the run uses): W / P
sequence-parallel groups of consecutive ranks, the Ulysses index innermost, then the WallFacer index in the order of
the placement (``comm.dims.PLACEMENTS``). The WallFacer semantics (teams, sub-rings, skew
and home partners) are ``comm.layout.RankLayout``'s: ``layouts`` builds them, and ``peer_indices`` is its
arithmetic unrolled for speed (a 1024-rank ``RankLayout`` takes ~20 ms; the planner looks at hundreds), checked
equal to ``RankLayout`` in the tests.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from dataclasses import dataclass

from ..comm.layout import RankLayout
from ..comm.dims import ParallelDims
from .candidate import Candidate
from .cluster import ClusterSpec

__all__ = ["LinkStats", "Links", "analyse_links", "layouts", "peer_indices", "sp_groups",
           "ulysses_groups", "dims_of"]


def dims_of(cand: Candidate, world_size: int) -> ParallelDims:
    """The sizes of ``cand`` over ``world_size`` ranks: the rank arithmetic the run itself uses."""
    return ParallelDims(world_size=world_size, sp_size=cand.sp_size, ulysses_degree=cand.ulysses_degree,
                       ring_count=cand.ring_count, placement=cand.placement)


def sp_groups(cand: Candidate, world_size: int) -> list[tuple[int, ...]]:
    """Every SP group's global ranks (consecutive blocks of P; data-parallel replicas are the blocks)."""
    return dims_of(cand, world_size).all_sp_ranks()


def layouts(cand: Candidate, world_size: int, ranks_per_node: int | None = None) -> list[RankLayout]:
    """The WallFacer ``RankLayout`` of every ring (W / R of them; U per SP group), for ``build_groups``."""
    return dims_of(cand, world_size).rank_layouts(ranks_per_node)


def ulysses_groups(cand: Candidate, world_size: int) -> list[tuple[int, ...]]:
    """Every Ulysses all-to-all group: U consecutive ranks (one per ring rank of each SP group)."""
    return dims_of(cand, world_size).all_ulysses_ranks()


def _peer_arrays(ring_size: int, ring_count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``peer_indices`` as arrays: team_next [R], ring_next [R], kv_dests [R, C], home_dests [R, C]."""
    c = ring_count
    g = ring_size // (c * c)
    index = np.arange(ring_size)
    team, local = np.divmod(index, c)
    group, pos = np.divmod(team, g)
    lane = np.arange(c)[None, :]

    def at(gr, ps, lc):
        return ((gr % c) * g + ps % g) * c + lc

    return (team * c + (local + 1) % c, at(group, pos + 1, local),
            at(group[:, None] - lane, pos[:, None], lane), at((group + local)[:, None], (pos + 1)[:, None], lane))


def peer_indices(ring_size: int, ring_count: int) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """For each WallFacer index: (team_next, ring_next, kv_dests, home_dests) indices, as ``RankLayout._place``
    (the skewed gather sends a rank's own k/v shard to ``kv_dests``; the last ring step's dk/dv go to
    ``home_dests``; the team collectives run as a ring over the team)."""
    t, r, kv, home = _peer_arrays(ring_size, ring_count)
    return [(int(t[i]), int(r[i]), tuple(map(int, kv[i])), tuple(map(int, home[i]))) for i in range(ring_size)]


@dataclass(frozen=True)
class LinkStats:
    """One traffic kind under one placement: the slowest sender's bandwidth and latency."""

    bw: float
    """Bytes/s of the slowest sending rank (inter-node senders share their node's NICs)."""
    latency: float
    offnode: float
    """Fraction of sending ranks whose traffic leaves the node."""

    @property
    def where(self) -> str:
        return "intra" if self.offnode == 0 else ("inter" if self.offnode == 1 else f"{self.offnode:.0%} inter")


@dataclass(frozen=True)
class Links:
    """Where each traffic kind of a candidate goes (kinds it does not use are None)."""

    team: LinkStats | None
    ring: LinkStats | None
    skew: LinkStats | None
    home: LinkStats | None
    a2a: LinkStats | None

    def describe(self) -> str:
        return " ".join(f"{k}:{s.where}" for k, s in vars(self).items() if s is not None)


def _flows(cluster: ClusterSpec, src: np.ndarray, dst: np.ndarray) -> LinkStats | None:
    """Concurrent sends src[i] -> dst[i, :]: each sender splits its bytes equally over its destinations
    (self-sends are local copies and dropped). Off-node flows of a node share its NICs; a sender's time is
    the slower of its intra-node and off-node parts; the slowest sender sets the bandwidth."""
    rpn = cluster.ranks_per_node
    real = dst != src[:, None]
    ndest = real.sum(axis=1)
    keep = ndest > 0
    if not keep.any():
        return None
    src, dst, real, ndest = src[keep], dst[keep], real[keep], ndest[keep]
    node = src // rpn
    far = ((dst // rpn != node[:, None]) & real).sum(axis=1)
    flows = np.bincount(node, weights=far)
    frac = far / ndest
    share = cluster.nic_bw * np.minimum(1.0, cluster.nics_per_node / np.maximum(flows[node], 1))
    t = np.maximum((1 - frac) / cluster.intra_bw, np.where(far > 0, frac / (np.maximum(far, 1) * share), 0.0))
    offnode = float((far > 0).mean())
    return LinkStats(bw=float(1 / t.max()), latency=cluster.inter_latency if offnode else cluster.intra_latency,
                     offnode=offnode)


def analyse_links(cand: Candidate, cluster: ClusterSpec) -> Links:
    """Links of the first SP group (ranks 0..P-1), all its rings and Ulysses groups sending at once."""
    p, u, r, c = cand.sp_size, cand.ulysses_degree, cand.ring_size, cand.ring_count
    stats: dict[str, LinkStats | None] = {}
    if r > 1:
        offs = np.array(cand.dims.ring_order)
        rank = (np.arange(u)[:, None] + u * offs[None, :])  # [U, R]: global rank of (u, WallFacer index)
        src = rank.reshape(-1)
        for kind, peers in zip(("team", "ring", "skew", "home"), _peer_arrays(r, c)):
            peers = peers.reshape(r, -1)  # [R, k]
            stats[kind] = _flows(cluster, src, rank[:, peers].reshape(u * r, -1))
    return Links(team=stats.get("team"), ring=stats.get("ring"), skew=stats.get("skew"), home=stats.get("home"),
                 a2a=_a2a(cluster, u, p) if u > 1 else None)


@lru_cache(maxsize=256)  # pure (ClusterSpec is frozen); shared by every C and placement of one (U, P)
def _a2a(cluster: ClusterSpec, u: int, p: int) -> LinkStats | None:
    """All-to-all in groups of U consecutive ranks: (U-1)/U of each rank's bytes, split over U-1 peers."""
    src = np.arange(p)
    return _flows(cluster, src, (src - src % u)[:, None] + np.arange(u)[None, :])
