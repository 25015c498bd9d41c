"""Communication config generator: the WallFacer rank layout, as pure Python.

``RankLayout`` describes one ring group: the R = P / U ranks of a sequence-parallel group that share a Ulysses
position (all P ranks when U = 1), with ring count C (C*C dividing R): its teams, sub-rings and skew partners, and
each rank's place in them (``RankPlace``). C = 1 gives one team per rank, one team group and one sub-ring of all R
ranks: plain ring attention. Nothing here imports ``torch.distributed``;
``groups.py`` turns a layout into process groups.

Words (index, team, local, team group, sub-ring, skew): the glossary in docs/design/index.md; the algorithm:
docs/design/attention.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["RankLayout", "RankPlace", "check_ring_count", "valid_ring_counts"]


def valid_ring_counts(sp_size: int) -> list[int]:
    """Ring counts C with C*C dividing ``sp_size`` (C = 1 always qualifies)."""
    return [c for c in range(1, sp_size + 1) if sp_size % (c * c) == 0]


def check_ring_count(ring_size: int, ring_count: int) -> None:
    """C*C divides the R ring ranks (the rule ``comm.dims`` and the planner's candidates share)."""
    r, c = ring_size, ring_count
    if not isinstance(c, int) or isinstance(c, bool) or c < 1 or r % (c * c):
        raise ValueError(
            f"wallfacer.ring_count = {c!r} is invalid for a ring dimension of {r} ranks (sequence_parallel_size / "
            f"ulysses_degree): C*C must divide {r}. Valid ring counts: {valid_ring_counts(r)}"
        )


@dataclass(frozen=True)
class RankPlace:
    """Where one rank sits in the layout and who it talks to (global ranks)."""

    index: int
    """Position in the ring group (the index)."""
    rank: int
    """Global rank."""
    team: int
    local: int
    group: int
    """Team group (ring communication group)."""
    pos: int
    """Position of the team inside its team group, 0..G-1 (position on the sub-ring)."""
    team_ranks: tuple[int, ...]
    """Global ranks of this rank's team, in ``local`` order."""
    ring_next: int
    """Sub-ring neighbour that k/v blocks are sent to."""
    ring_prev: int
    """Sub-ring neighbour that k/v blocks are received from."""
    kv_sources: tuple[int, ...]
    """Members of the team whose k/v this rank holds at ring step 0, in ``local`` order (skewed gather)."""
    kv_dests: tuple[int, ...]
    """Ranks that gather this rank's own k/v shard, entry j in lane ``local = j`` (itself only if local 0)."""
    home_dests: tuple[int, ...]
    """Members of the team whose dk/dv this rank holds after the last ring step (backward)."""
    home_sources: tuple[int, ...]
    """Ranks that return this rank's dk/dv slice after the last ring step, entry j from lane j."""
    kv_team: int
    """Team whose k/v this rank holds at ring step 0."""


@dataclass(frozen=True)
class RankLayout:
    """The WallFacer layout of one ring group (R = P / U ranks; the whole sequence-parallel group when U = 1).

    ``ranks`` are the global ranks of the group in order; consecutive entries form teams, so a team stays
    inside one node when C divides ``ranks_per_node`` and the group's ranks are consecutive.
    """

    ranks: tuple[int, ...]
    """Global ranks of the ring group, in index order (``ParallelDims.ring_ranks``)."""
    ring_count: int
    """C: concurrent sub-rings per team group; team size."""
    ranks_per_node: int | None = None
    """Ranks per node (for placement reports); None when unknown."""
    places: tuple[RankPlace, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        ranks = tuple(int(r) for r in self.ranks)
        object.__setattr__(self, "ranks", ranks)
        p, c = len(ranks), self.ring_count
        if p < 1:
            raise ValueError("ring group is empty: it needs at least one rank")
        if len(set(ranks)) != p:
            raise ValueError(f"ring group ranks {ranks} contain duplicates")
        check_ring_count(p, c)
        if self.ranks_per_node is not None and self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node={self.ranks_per_node} must be >= 1")
        object.__setattr__(self, "places", tuple(self._place(i) for i in range(p)))

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def ring_size(self) -> int:
        """R: the ranks of this ring group (P / U)."""
        return len(self.ranks)

    @property
    def group_size(self) -> int:
        """G = R / C^2: teams per team group, the length of every sub-ring, the number of ring steps."""
        return self.ring_size // (self.ring_count**2)

    @property
    def num_teams(self) -> int:
        return self.ring_size // self.ring_count

    # -- coordinates -----------------------------------------------------------------------------
    def index_of(self, *, group: int, pos: int, local: int) -> int:
        c, g = self.ring_count, self.group_size
        return ((group % c) * g + pos % g) * c + local

    def teams(self) -> list[tuple[int, ...]]:
        """Global ranks of every team, in team order (the process groups for the team collectives)."""
        c = self.ring_count
        return [self.ranks[t * c : (t + 1) * c] for t in range(self.num_teams)]

    def place_of_rank(self, rank: int) -> RankPlace:
        try:
            return self.places[self.ranks.index(rank)]
        except ValueError:
            raise ValueError(f"global rank {rank} is not in this ring group {self.ranks}") from None

    def _place(self, index: int) -> RankPlace:
        c, g = self.ring_count, self.group_size
        team, local = divmod(index, c)
        group, pos = divmod(team, g)
        r = self.ranks

        def at(gr: int, ps: int, lc: int = local) -> int:
            return r[self.index_of(group=gr, pos=ps, local=lc)]

        return RankPlace(
            index=index,
            rank=r[index],
            team=team,
            local=local,
            group=group,
            pos=pos,
            team_ranks=r[team * c : (team + 1) * c],
            ring_next=at(group, pos + 1),
            ring_prev=at(group, pos - 1),
            kv_sources=tuple(at(group + local, pos, m) for m in range(c)),
            kv_dests=tuple(at(group - j, pos, j) for j in range(c)),
            home_dests=tuple(at(group + local, pos + 1, m) for m in range(c)),
            home_sources=tuple(at(group - j, pos - 1, j) for j in range(c)),
            kv_team=((group + local) % c) * g + pos,
        )

    def home_peers(self, index: int, steps: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """After a ring cut to ``steps`` steps (sliding windows need no more): the ranks rank ``index`` sends the
        dk/dv slices of its last block to (one per lane of that block's team), and the ranks it receives its own
        slices from. ``steps = G`` gives ``home_dests`` / ``home_sources``."""
        c, g = self.ring_count, self.group_size
        team, local = divmod(index, c)
        group, pos = divmod(team, g)
        r = self.ranks
        dests = tuple(r[self.index_of(group=group + local, pos=pos - (steps - 1), local=m)] for m in range(c))
        sources = tuple(r[self.index_of(group=group - j, pos=pos + (steps - 1), local=j)] for j in range(c))
        return dests, sources

    # -- placement -------------------------------------------------------------------------------
    def node_of(self, rank: int) -> int | None:
        return None if self.ranks_per_node is None else rank // self.ranks_per_node

    def teams_cross_nodes(self) -> bool:
        """True when some team spans two nodes (its all-gathers then leave the node)."""
        if self.ranks_per_node is None:
            return False
        return any(len({self.node_of(x) for x in team}) > 1 for team in self.teams())

    def describe(self) -> str:
        """A printable table of the layout: one line per rank."""
        head = (
            f"WallFacer layout: R={self.ring_size} C={self.ring_count} G={self.group_size} "
            f"teams={self.num_teams}" + ("  (a team crosses nodes!)" if self.teams_cross_nodes() else "")
        )
        lines = [head, "rank idx team local group pos  prev next  kv_team  kv_sources"]
        for p in self.places:
            lines.append(
                f"{p.rank:4d} {p.index:3d} {p.team:4d} {p.local:5d} {p.group:5d} {p.pos:3d} "
                f"{p.ring_prev:5d} {p.ring_next:4d}  {p.kv_team:7d}  {list(p.kv_sources)}"
            )
        return "\n".join(lines)
