"""Rank placement: which global ranks form each sequence-parallel group, ring and Ulysses group, and which
links every traffic kind crosses (issue 5, "Rank placement").

A world of W ranks is cut into W / P sequence-parallel groups of consecutive ranks (data parallel outside). In a
group the Ulysses index u is innermost (an all-to-all group is U consecutive ranks), then the WallFacer ring
index in the order of the placement (``candidate.PLACEMENTS``). The WallFacer semantics (teams, sub-rings, skew
and home partners) are ``comm.layout.RankLayout``'s: ``layouts`` builds them, and ``peer_indices`` is its
arithmetic unrolled for speed (a 1024-rank ``RankLayout`` takes ~20 ms; the planner looks at hundreds), checked
equal to ``RankLayout`` in the tests.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from dataclasses import dataclass

from ..comm.layout import RankLayout
from .candidate import Candidate
from .cluster import ClusterSpec

__all__ = ["LinkStats", "Links", "analyse_links", "layouts", "peer_indices", "ring_offset", "sp_groups",
           "ulysses_groups"]


def ring_offset(index: int, *, ring_size: int, ring_count: int, placement: str) -> int:
    """Position among the ring ranks (before the Ulysses stride) of WallFacer index ``index``."""
    if placement == "team-inner":
        return index
    c = ring_count
    g = ring_size // (c * c)
    team, local = divmod(index, c)
    group, pos = divmod(team, g)
    return pos + g * (local + c * group)


def ring_ranks(cand: Candidate, *, base: int = 0, u: int = 0) -> tuple[int, ...]:
    """Global ranks of the u-th WallFacer ring of the SP group starting at ``base``, in index order."""
    r, c, uu = cand.ring_size, cand.ring_count, cand.ulysses_degree
    return tuple(base + u + uu * ring_offset(i, ring_size=r, ring_count=c, placement=cand.placement) for i in range(r))


def sp_groups(cand: Candidate, world_size: int) -> list[tuple[int, ...]]:
    """Every SP group's global ranks (consecutive blocks of P; data-parallel replicas are the blocks)."""
    p = cand.sp_size
    if world_size % p:
        raise ValueError(f"sp_size={p} does not divide world size {world_size}")
    return [tuple(range(b, b + p)) for b in range(0, world_size, p)]


def layouts(cand: Candidate, world_size: int, ranks_per_node: int | None = None) -> list[RankLayout]:
    """The WallFacer ``RankLayout`` of every ring (W / R of them; U per SP group), for ``build_groups``."""
    return [
        RankLayout(ring_ranks(cand, base=g[0], u=u), cand.ring_count, ranks_per_node)
        for g in sp_groups(cand, world_size)
        for u in range(cand.ulysses_degree)
    ]


def ulysses_groups(cand: Candidate, world_size: int) -> list[tuple[int, ...]]:
    """Every Ulysses all-to-all group: U consecutive ranks (one per ring index of each SP group)."""
    u = cand.ulysses_degree
    return [tuple(range(b, b + u)) for b in range(0, world_size, u)]


@lru_cache(maxsize=256)  # pure; memoised because the planner asks for the same (R, C) under many settings
def peer_indices(ring_size: int, ring_count: int) -> tuple[tuple[int, int, int, int], ...]:
    """For each WallFacer index: (team_next, ring_next, skew_to, home_to) indices, as ``RankLayout._place``."""
    c = ring_count
    g = ring_size // (c * c)
    out = []
    for index in range(ring_size):
        team, local = divmod(index, c)
        group, pos = divmod(team, g)

        def at(gr: int, ps: int) -> int:
            return ((gr % c) * g + ps % g) * c + local

        out.append((team * c + (local + 1) % c, at(group, pos + 1), at(group - local, pos), at(group + local, pos + 1)))
    return tuple(out)


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


def _stats(cluster: ClusterSpec, src: list[int], dst: list[int]) -> LinkStats | None:
    """Point-to-point sends src[i] -> dst[i] that run at the same time (self-sends are local copies)."""
    rpn = cluster.ranks_per_node
    total, intra = 0, False
    off: Counter[int] = Counter()
    for a, b in zip(src, dst):
        if a == b:
            continue
        total += 1
        if a // rpn != b // rpn:
            off[a // rpn] += 1
        else:
            intra = True
    if not total:
        return None
    if not off:
        return LinkStats(bw=cluster.intra_bw, latency=cluster.intra_latency, offnode=0.0)
    bw = cluster.offnode_bw(max(off.values()))  # the node with the most off-node senders is the slowest
    bw = min(bw, cluster.intra_bw) if intra else bw
    return LinkStats(bw=bw, latency=cluster.inter_latency, offnode=sum(off.values()) / total)


@lru_cache(maxsize=256)  # pure (ClusterSpec is frozen); shared by every C and placement of one (U, P)
def _a2a_stats(cluster: ClusterSpec, u: int, p: int) -> LinkStats | None:
    """All-to-all in groups of U consecutive ranks over one SP group: each rank sends (U-1)/U of its bytes,
    the off-node part over the shared NICs, the rest over the intra-node links at the same time."""
    if u == 1:
        return None
    rpn = cluster.ranks_per_node
    far: list[int] = []
    senders: Counter[int] = Counter()
    for rank in range(p):
        base, node = rank - rank % u, rank // rpn
        near = min(base + u, (node + 1) * rpn) - max(base, node * rpn)  # group members on my node, me included
        far.append(u - near)
        if u - near:
            senders[node] += 1
    worst = 0.0
    for rank, f in enumerate(far):
        frac = f / (u - 1)
        t = (1 - frac) / cluster.intra_bw
        if f:
            t = max(t, frac / cluster.offnode_bw(senders[rank // rpn]))
        worst = max(worst, t)
    offnode = sum(1 for f in far if f)
    lat = cluster.inter_latency if offnode else cluster.intra_latency
    return LinkStats(bw=1 / worst, latency=lat, offnode=offnode / p)


def analyse_links(cand: Candidate, cluster: ClusterSpec) -> Links:
    """Links of the first SP group (ranks 0..P-1), all its rings and Ulysses groups sending at once."""
    p, u, r, c = cand.sp_size, cand.ulysses_degree, cand.ring_size, cand.ring_count
    offs = [ring_offset(i, ring_size=r, ring_count=c, placement=cand.placement) for i in range(r)]
    src = [uu + u * o for uu in range(u) for o in offs]
    stats = {}
    for kind, column in zip(("team", "ring", "skew", "home"), zip(*peer_indices(r, c)) if r > 1 else ()):
        dst = [uu + u * offs[j] for uu in range(u) for j in column]
        stats[kind] = _stats(cluster, src, dst)
    return Links(team=stats.get("team"), ring=stats.get("ring"), skew=stats.get("skew"), home=stats.get("home"),
                 a2a=_a2a_stats(cluster, u, p))
