"""The world layout: which global rank plays which part (docs/design.md §3, Note [World layout]). Pure Python.

W = D x P ranks: D data-parallel replicas of P sequence-parallel ranks each; rank ``d * P + i`` is index ``i`` of
replica ``d``. Inside a sequence-parallel group ``i = r * U + u``: U consecutive ranks form a Ulysses group, and
the R = P / U ranks with the same ``u`` form one WallFacer group (ring count C, ``layout.RankLayout``) over which
ring rank ``r`` runs. The placement decides which ring rank holds WallFacer index ``j = team * C + local``:
"team-inner" keeps teams on consecutive ranks (r = j), "ring-inner" keeps sub-rings on consecutive ranks
(``ring_offset``).

This is the one home of the rank arithmetic: the resolved config (``config.ParallelLayout``), the process groups
(``integration.parallel``) and the planner (``planner.placement``) all ask a ``WorldLayout``.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from .layout import RankLayout, valid_ring_counts

__all__ = ["PLACEMENTS", "WorldLayout", "divisors", "ring_offset"]

PLACEMENTS: tuple[str, ...] = ("team-inner", "ring-inner")
"""How a WallFacer group's indices map to consecutive ranks, fastest-varying first (after the Ulysses index):

- ``team-inner``: team member, then sub-ring position: teams on consecutive ranks (team collectives inside a node
  when U*C divides the ranks per node); the default.
- ``ring-inner``: sub-ring position, then team member: each sub-ring of G ranks on consecutive ranks (ring hops
  inside a node when U*G divides the ranks per node; teams then span nodes).
"""


def divisors(n: int) -> list[int]:
    """Positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def ring_offset(index: int, *, ring_size: int, ring_count: int, placement: str) -> int:
    """Ring rank (position among the R ring ranks, before the Ulysses stride) of WallFacer index ``index``."""
    if placement == "team-inner":
        return index
    c = ring_count
    g = ring_size // (c * c)
    team, local = divmod(index, c)
    group, pos = divmod(team, g)
    return pos + g * (local + c * group)


@dataclass(frozen=True)
class WorldLayout:
    """Sizes of the world's dimensions and the placement; validated on construction."""

    world_size: int
    """W: all ranks."""
    sp_size: int
    """P: ranks that share one sequence."""
    ulysses_degree: int = 1
    """U: consecutive ranks of one Ulysses all-to-all group."""
    ring_count: int = 1
    """C: WallFacer ring count over the R = P / U ring ranks (C*C divides R)."""
    placement: str = "team-inner"
    """``PLACEMENTS``."""

    def __post_init__(self) -> None:
        w, p, u, c = self.world_size, self.sp_size, self.ulysses_degree, self.ring_count
        if self.placement not in PLACEMENTS:
            raise ValueError(f"wallfacer.placement = {self.placement!r} is invalid: allowed are {PLACEMENTS}")
        if w < 1 or p < 1 or w % p:
            raise ValueError(
                f"wallfacer.sequence_parallel_size = {p} does not divide the world size {w}: valid sizes for "
                f"{w} ranks are {divisors(w)}"
            )
        if u < 1 or p % u:
            raise ValueError(
                f"wallfacer.ulysses_degree = {u} does not divide sequence_parallel_size {p}: valid degrees are "
                f"{divisors(p)} (and they must fit the model's heads)"
            )
        r = p // u
        if c < 1 or r % (c * c):
            raise ValueError(
                f"wallfacer.ring_count = {c} is invalid for a ring dimension of {r} ranks (sequence_parallel_size {p}"
                f" / ulysses_degree {u}): C*C must divide {r}. Valid ring counts: {valid_ring_counts(r)}"
            )

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """D: data-parallel replicas (sequence-parallel groups)."""
        return self.world_size // self.sp_size

    @property
    def ring_size(self) -> int:
        """R = P / U: ranks of one WallFacer group."""
        return self.sp_size // self.ulysses_degree

    # -- one rank ----------------------------------------------------------------------------------------
    def dp_index(self, rank: int) -> int:
        """The replica of global ``rank``."""
        return rank // self.sp_size

    def sp_index(self, rank: int) -> int:
        """Position of global ``rank`` in its sequence-parallel group (``i = r * U + u``)."""
        return rank % self.sp_size

    def shard_index(self, rank: int) -> int:
        """The data shard ``rank`` holds: ``j * U + u`` with ``j`` its WallFacer index, the ring chunk its attention
        expects (``data.loader.ShardSpec.index``). Equals ``sp_index`` unless the placement permutes ring ranks."""
        r, u = divmod(self.sp_index(rank), self.ulysses_degree)
        return self.ring_order.index(r) * self.ulysses_degree + u

    # -- groups ------------------------------------------------------------------------------------------
    @cached_property
    def ring_order(self) -> tuple[int, ...]:
        """Ring rank of each WallFacer index (the identity unless "ring-inner" permutes it)."""
        r, c = self.ring_size, self.ring_count
        return tuple(ring_offset(i, ring_size=r, ring_count=c, placement=self.placement) for i in range(r))

    def sp_ranks(self, dp: int) -> tuple[int, ...]:
        """Global ranks of sequence-parallel group ``dp``, in index order."""
        return tuple(range(dp * self.sp_size, (dp + 1) * self.sp_size))

    def ulysses_ranks(self, dp: int, ring: int) -> tuple[int, ...]:
        """Global ranks of the Ulysses group at ring rank ``ring`` of replica ``dp`` (consecutive)."""
        base = dp * self.sp_size + ring * self.ulysses_degree
        return tuple(range(base, base + self.ulysses_degree))

    def ring_ranks(self, dp: int, u: int) -> tuple[int, ...]:
        """Global ranks of the WallFacer group with Ulysses index ``u`` of replica ``dp``, in WallFacer index
        order (``RankLayout.ranks``)."""
        base = dp * self.sp_size
        return tuple(base + r * self.ulysses_degree + u for r in self.ring_order)

    def all_sp_ranks(self) -> list[tuple[int, ...]]:
        """Every sequence-parallel group, by replica."""
        return [self.sp_ranks(d) for d in range(self.dp_size)]

    def all_ulysses_ranks(self) -> list[tuple[int, ...]]:
        """Every Ulysses group, by replica then ring rank."""
        return [self.ulysses_ranks(d, r) for d in range(self.dp_size) for r in range(self.ring_size)]

    def rank_layouts(self, ranks_per_node: int | None = None) -> list[RankLayout]:
        """The ``RankLayout`` of every WallFacer group (D * U of them), by replica then Ulysses index: the list
        ``comm.build_groups`` takes, identical on every rank."""
        return [
            RankLayout(self.ring_ranks(d, u), self.ring_count, ranks_per_node=ranks_per_node)
            for d in range(self.dp_size)
            for u in range(self.ulysses_degree)
        ]
