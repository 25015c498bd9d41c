"""The parallel sizes, validated once, and the rank arithmetic that derives from them (docs/design/layouts.md,
Note [World layout]). Pure Python.

``ParallelDims`` holds W, D, P, U, R, C, the placement, the mode and the model's heads; each rule below has one
function and one error text, which the config parser, the planner's candidates and ``RankLayout`` share. ``Mode``
and ``Strategy`` are the one vocabulary for the attention across ranks: every question about a mode (does it have
a ring? which Ulysses degree does it imply? which strategies does it run?) is a method here, not a string
comparison at the caller.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from .layout import RankLayout, check_ring_count

__all__ = ["MODES", "Mode", "PLACEMENTS", "ParallelDims", "STRATEGIES", "Strategy", "check_heads", "check_mode",
           "check_placement", "check_sp_size", "check_ulysses_degree", "divisors", "dynamic_sizes", "ring_offset",
           "splits_heads", "sub_dims", "valid_ulysses_degrees"]


class _Word(StrEnum):
    # repr as the bare word: lists of modes in error messages and notes read as they did when they were strings
    def __repr__(self) -> str:
        return repr(self.value)


class Mode(_Word):
    """Attention across ranks once resolved (``wallfacer.mode``; the config also accepts "auto", which start-up
    resolves to one of these). A ``str``: configs, logs, JSON and comparisons with the word read its value."""

    WALLFACER = "wallfacer"
    """WallFacer over all P ranks (U = 1); ring attention when C = 1."""
    ULYSSES = "ulysses"
    """Ulysses all-to-all over all P ranks (U = P, C = 1)."""
    HYBRID = "hybrid"
    """Ulysses over U consecutive ranks inside WallFacer over the R = P / U others (1 < U < P)."""

    @classmethod
    def parse(cls, value: str) -> Mode:
        """``value`` as a mode; ``ValueError`` naming the allowed words (with "auto", which only the config takes)."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(map(repr, (*MODES, "auto")))
            raise ValueError(f"wallfacer.mode = {value!r} is invalid: allowed are {allowed}") from None

    @classmethod
    def from_sizes(cls, sp_size: int, ulysses_degree: int) -> Mode:
        """The mode of Ulysses degree U over P ranks: wallfacer (U = 1), ulysses (U = P > 1), else hybrid."""
        if ulysses_degree == 1:
            return cls.WALLFACER
        return cls.ULYSSES if ulysses_degree == sp_size else cls.HYBRID

    @property
    def has_ring(self) -> bool:
        """WallFacer runs over ring ranks (R = P / U, any C): wallfacer and hybrid; ulysses has R = 1, C = 1."""
        return self is not Mode.ULYSSES

    @property
    def has_ulysses(self) -> bool:
        """Heads cross ranks by all-to-all (U > 1): ulysses and hybrid."""
        return self is not Mode.WALLFACER

    def ulysses_degree(self, sp_size: int) -> int | None:
        """The U this mode implies for P = ``sp_size`` ranks: 1 (wallfacer), P (ulysses); None for hybrid, whose
        degree is a choice."""
        if not self.has_ulysses:
            return 1
        return None if self.has_ring else sp_size

    def admits(self, strategy: str) -> bool:
        """Whether a run fixed to this mode may use the planner's ``strategy`` (``Strategy.mode``)."""
        return Strategy(strategy).mode is self


class Strategy(_Word):
    """What a planner candidate runs across ranks: finer than ``Mode``, it tells plain ring (mode wallfacer with
    C = 1) and a single rank (P = 1, no sequence parallelism) apart."""

    NONE = "none"
    RING = "ring"
    WALLFACER = "wallfacer"
    ULYSSES = "ulysses"
    HYBRID = "hybrid"

    @classmethod
    def of(cls, *, sp_size: int, ulysses_degree: int, ring_count: int) -> Strategy:
        """none (P = 1), ring (U = 1, C = 1), wallfacer (U = 1, C > 1), ulysses (U = P), hybrid (1 < U < P)."""
        if sp_size == 1:
            return cls.NONE
        mode = Mode.from_sizes(sp_size, ulysses_degree)
        if mode.has_ulysses:
            return cls(mode.value)
        return cls.WALLFACER if ring_count > 1 else cls.RING

    @property
    def mode(self) -> Mode:
        """The config's mode that runs it: ring and none are wallfacer with C = 1 (none on one rank)."""
        return Mode.WALLFACER if self in (Strategy.NONE, Strategy.RING) else Mode(self.value)

    @property
    def splits_sequence(self) -> bool:
        """More than one rank shares the sequence (every strategy but none)."""
        return self is not Strategy.NONE

    def allowed_by(self, fixed: str) -> bool:
        """Whether the planner's fixed ``mode`` allows this strategy: a mode word allows every strategy it runs
        (``Mode.admits``: "wallfacer" includes ring and one rank), "ring" and "none" only themselves."""
        return Mode(fixed).admits(self) if fixed in MODES else self is Strategy(fixed)


MODES: tuple[str, ...] = tuple(m.value for m in Mode)
"""The words of ``Mode`` (the config also accepts "auto")."""

STRATEGIES: tuple[str, ...] = tuple(s.value for s in Strategy)
"""The words of ``Strategy``."""

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


# -- the rules: one function and one error text each -----------------------------------------------------------
def check_placement(placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"wallfacer.placement = {placement!r} is invalid: allowed are {PLACEMENTS}")


def check_sp_size(world_size: int, sp_size: int, *, valid: list[int] | None = None) -> None:
    """P divides W. ``valid``: the sizes to offer instead (default: every divisor of W)."""
    if world_size < 1 or sp_size < 1 or world_size % sp_size:
        also = "" if valid is None else " (with the other wallfacer settings as given)"
        raise ValueError(
            f"wallfacer.sequence_parallel_size = {sp_size} does not divide the world size {world_size}: valid sizes "
            f"for {world_size} ranks are {divisors(world_size) if valid is None else valid}{also}"
        )


def check_ulysses_degree(sp_size: int, ulysses_degree: int) -> None:
    """U divides P."""
    p, u = sp_size, ulysses_degree
    if u < 1 or p % u:
        raise ValueError(
            f"wallfacer.ulysses_degree = {u} does not divide sequence_parallel_size {p}: valid degrees are "
            f"{divisors(p)} (and they must fit the model's heads)"
        )


def check_mode(mode: str, *, ulysses_degree: int | str, ring_count: int | str = 1,
               sp_size: int | str | None = None) -> None:
    """The mode agrees with the sizes: wallfacer has U = 1, ulysses has U = P and C = 1. Sizes may be "auto" (or P
    unknown), which this rule leaves to the planner."""
    u, c, p = ulysses_degree, ring_count, sp_size
    m = Mode.parse(mode)
    if not m.has_ulysses and u not in ("auto", 1):
        raise ValueError(
            f'wallfacer.ulysses_degree = {u} needs mode "hybrid" (or "ulysses"); mode "{m}" has no Ulysses '
            f'dimension (use 1 or "auto")'
        )
    if not m.has_ring and c not in ("auto", 1):
        raise ValueError(
            f'wallfacer.ring_count = {c} needs mode "wallfacer" or "hybrid"; mode "{m}" has no ring dimension '
            f'(use 1 or "auto")'
        )
    if not m.has_ring and isinstance(p, int) and u not in ("auto", p):
        raise ValueError(
            f'mode "{m}" needs ulysses_degree = sequence_parallel_size = {p}, got {u}; use mode "hybrid" for a '
            f"smaller Ulysses degree"
        )


def _ulysses_fits(u: int, num_heads: int, num_kv_heads: int) -> bool:
    # kv heads are split when U divides them, replicated U/hk times when hk divides U (as DeepSpeed does)
    return num_heads % u == 0 and (num_kv_heads % u == 0 or u % num_kv_heads == 0)


def valid_ulysses_degrees(sp_size: int, num_heads: int, num_kv_heads: int) -> list[int]:
    """Degrees U that divide P and the query heads, and divide or are a multiple of the kv heads."""
    return [u for u in divisors(sp_size) if _ulysses_fits(u, num_heads, num_kv_heads)]


def splits_heads(sp_size: int, whole_heads: tuple[int, ...] = (), head_groups: tuple[int, ...] = ()) -> bool:
    """Whether ``sp_size`` ranks can each scan whole heads of the layers that do (gated delta-nets, Mamba-2
    mixers): every count of ``whole_heads`` divides by P, every count of ``head_groups`` divides P or by it."""
    return all(h % sp_size == 0 for h in whole_heads) and all(g % sp_size == 0 or sp_size % g == 0
                                                              for g in head_groups)


def check_heads(num_heads: int, num_kv_heads: int, *, ulysses_degree: int, sp_size: int) -> None:
    """The heads group evenly, and U fits them (splits the query heads; splits or replicates the kv heads)."""
    hq, hk, u = num_heads, num_kv_heads, ulysses_degree
    if hq < 1 or hk < 1 or hq % hk:
        raise ValueError(f"the model's {hq} query heads are not a multiple of its {hk} kv heads")
    if not _ulysses_fits(u, hq, hk):
        raise ValueError(
            f"wallfacer.ulysses_degree = {u} does not fit the model's heads ({hq} query, {hk} kv): U must divide the "
            f"query heads and divide or be a multiple of the kv heads. Valid degrees for sequence_parallel_size "
            f"{sp_size}: {valid_ulysses_degrees(sp_size, hq, hk)}"
        )


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of the world's dimensions, the placement, the mode and the model's heads; validated on construction.
    Every rank question (which group, which shard) is answered here."""

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

    mode: Mode | None = None
    """The attention across ranks (a ``Mode``; its word is parsed); None: derived from the sizes
    (``Mode.from_sizes``)."""
    num_heads: int | None = None
    """Query heads of the model (None: no head rule, e.g. in the planner's pure rank arithmetic)."""
    num_kv_heads: int | None = None
    """Key/value heads of the model (None: as many as the query heads)."""

    def __post_init__(self) -> None:
        w, p, u, c = self.world_size, self.sp_size, self.ulysses_degree, self.ring_count
        check_placement(self.placement)
        check_sp_size(w, p)
        check_ulysses_degree(p, u)
        mode = Mode.from_sizes(p, u) if self.mode is None else Mode.parse(self.mode)
        object.__setattr__(self, "mode", mode)
        check_mode(mode, ulysses_degree=u, ring_count=c, sp_size=p)
        check_ring_count(p // u, c)
        if self.num_heads is not None:
            check_heads(self.num_heads, self.num_kv_heads or self.num_heads, ulysses_degree=u, sp_size=p)

    # -- sizes -------------------------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """D: data-parallel replicas (sequence-parallel groups)."""
        return self.world_size // self.sp_size

    @property
    def ring_size(self) -> int:
        """R = P / U: ranks of one WallFacer group."""
        return self.sp_size // self.ulysses_degree

    @property
    def group_size(self) -> int:
        """G = R / C^2: teams per team group, the length of each sub-ring (``RankLayout.group_size``)."""
        return self.ring_size // (self.ring_count**2)

    @property
    def strategy(self) -> Strategy:
        """The planner's finer word for these sizes (``Strategy.of``)."""
        return Strategy.of(sp_size=self.sp_size, ulysses_degree=self.ulysses_degree, ring_count=self.ring_count)

    @property
    def placement_matters(self) -> bool:
        """Whether the placement changes which ranks talk: only with C > 1 teams in G > 1 team groups (otherwise
        "ring-inner" gives the identity order, as "team-inner" does)."""
        return self.ring_count > 1 and self.group_size > 1

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


# -- dynamic sequence parallelism: the smaller groups inside each sequence-parallel group ------------------------
def sub_dims(dims: ParallelDims, size: int) -> ParallelDims:
    """The layout of groups of ``size`` consecutive ranks (``size`` divides P) in the shape of ``dims``: the Ulysses
    degree as large as it was, up to ``size``; the ring count as large as it was that still fits the ring ranks.
    Raises ``ValueError`` (the heads rule's text) when that Ulysses degree does not fit the model's heads."""
    p = dims.sp_size
    if size < 1 or p % size:
        raise ValueError(f"group size {size} does not divide sequence_parallel_size {p}")
    if size == p:
        return dims
    u = math.gcd(dims.ulysses_degree, size)
    ring = size // u
    c = max(c for c in divisors(dims.ring_count) if ring % (c * c) == 0)
    return ParallelDims(world_size=dims.world_size, sp_size=size, ulysses_degree=u, ring_count=c,
                        placement=dims.placement, num_heads=dims.num_heads, num_kv_heads=dims.num_kv_heads)


def dynamic_sizes(dims: ParallelDims, *, whole_heads: tuple[int, ...] = (),
                  head_groups: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The group sizes dynamic sequence parallelism may give a row, ascending: 1, every power of two dividing P and
    P itself, keeping those whose Ulysses degree fits the attention heads and whose ranks split the heads of the
    head-parallel mixers (``whole_heads``, ``head_groups``: ``splits_heads``). P itself always stays (it was
    validated as the run's size); 1 always fits (no sequence parallelism)."""
    p = dims.sp_size
    keep = []
    for size in sorted({1, p, *(1 << k for k in range(p.bit_length()) if p % (1 << k) == 0)}):
        if size not in (1, p):
            try:
                sub_dims(dims, size)
            except ValueError:
                continue
            if not splits_heads(size, whole_heads, head_groups):
                continue
        keep.append(size)
    return tuple(keep)
