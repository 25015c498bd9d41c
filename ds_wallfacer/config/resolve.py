"""From a parsed ``WallFacerConfig`` + world size + model heads to the one validated ``ParallelLayout``.

Rank arithmetic (pure; no torch): world = D data-parallel replicas x P sequence-parallel ranks; rank
``d * P + i`` is index i of replica d. In a sequence-parallel group, index ``i = r * U + u``: U consecutive
ranks form a Ulysses group (inner, one node), R = P / U ring ranks with the same ``u`` form a WallFacer
group of ring count C (outer). mode "wallfacer" is U = 1, mode "ulysses" is U = P (R = 1).

``resolve_auto`` is the one place where "auto" values are chosen; the topology planner plugs in there.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from .schema import MODES, SHARDINGS, WallFacerConfig

__all__ = ["ParallelLayout", "resolve_auto", "valid_ulysses_degrees"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ring_counts(r: int) -> list[int]:
    return [c for c in range(1, r + 1) if r % (c * c) == 0]


def _ulysses_ok(u: int, num_heads: int, num_kv_heads: int) -> bool:
    # kv heads are split when U divides them, replicated U/hk times when hk divides U (as DeepSpeed does)
    return num_heads % u == 0 and (num_kv_heads % u == 0 or u % num_kv_heads == 0)


def valid_ulysses_degrees(sp_size: int, num_heads: int, num_kv_heads: int) -> list[int]:
    """Degrees U that divide P and the query heads, and divide or are a multiple of the kv heads."""
    return [u for u in _divisors(sp_size) if _ulysses_ok(u, num_heads, num_kv_heads)]


@dataclass(frozen=True)
class ParallelLayout:
    """The resolved and validated parallel layout; the same on every rank."""

    world_size: int
    """All ranks."""
    sp_size: int
    """P: ranks per sequence-parallel group."""
    mode: str
    """"wallfacer" | "ulysses" | "hybrid"."""
    ulysses_degree: int
    """U: Ulysses group size (1 = none)."""
    ring_count: int
    """C: WallFacer ring count over the R = P / U ring ranks."""
    num_heads: int
    """Query heads of the model."""
    num_kv_heads: int
    """Key/value heads of the model."""
    sharding: str = "zigzag"
    """Chunk layout over the ring dimension."""
    kernel: str = "auto"
    """Block-attention kernel name."""
    ranks_per_node: int | None = None
    """Ranks per node (None: unknown)."""
    notes: tuple[str, ...] = ()
    """What "auto" chose and why (logged at start-up)."""

    def __post_init__(self) -> None:
        w, p, u, c = self.world_size, self.sp_size, self.ulysses_degree, self.ring_count
        hq, hk = self.num_heads, self.num_kv_heads
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is invalid: allowed are {MODES}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding {self.sharding!r} is invalid: allowed are {SHARDINGS}")
        if w < 1 or p < 1 or w % p:
            raise ValueError(
                f"wallfacer.sequence_parallel_size = {p} does not divide the world size {w}: valid sizes for "
                f"{w} ranks are {_divisors(w)}"
            )
        if hq < 1 or hk < 1 or hq % hk:
            raise ValueError(f"the model's {hq} query heads are not a multiple of its {hk} kv heads")
        if p % u:
            raise ValueError(
                f"wallfacer.ulysses_degree = {u} does not divide sequence_parallel_size {p}: valid degrees are "
                f"{valid_ulysses_degrees(p, hq, hk)}"
            )
        if self.mode == "wallfacer" and u != 1:
            raise ValueError(f'mode "wallfacer" needs ulysses_degree 1, got {u}')
        if self.mode == "ulysses" and u != p:
            raise ValueError(
                f'mode "ulysses" needs ulysses_degree = sequence_parallel_size = {p}, got {u}; use mode "hybrid" '
                f"for a smaller Ulysses degree"
            )
        if not _ulysses_ok(u, hq, hk):
            raise ValueError(
                f"wallfacer.ulysses_degree = {u} does not fit the model's heads ({hq} query, {hk} kv): U must divide "
                f"the query heads and divide or be a multiple of the kv heads. Valid degrees for "
                f"sequence_parallel_size {p}: {valid_ulysses_degrees(p, hq, hk)}"
            )
        r = p // u
        if c < 1 or r % (c * c):
            raise ValueError(
                f"wallfacer.ring_count = {c} is invalid for a ring dimension of {r} ranks (sequence_parallel_size {p}"
                f" / ulysses_degree {u}): C*C must divide {r}. Valid ring counts: {_ring_counts(r)}"
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

    # -- rank arithmetic ------------------------------------------------------------------------------------
    def sp_index(self, rank: int) -> int:
        return rank % self.sp_size

    def dp_index(self, rank: int) -> int:
        return rank // self.sp_size

    def sp_ranks(self, dp: int) -> tuple[int, ...]:
        """Global ranks of sequence-parallel group ``dp``, in index order."""
        return tuple(range(dp * self.sp_size, (dp + 1) * self.sp_size))

    def ulysses_ranks(self, dp: int, ring: int) -> tuple[int, ...]:
        """Global ranks of the Ulysses group at ring position ``ring`` of replica ``dp`` (consecutive)."""
        base = dp * self.sp_size + ring * self.ulysses_degree
        return tuple(range(base, base + self.ulysses_degree))

    def ring_ranks(self, dp: int, u: int) -> tuple[int, ...]:
        """Global ranks of the WallFacer group with Ulysses index ``u`` of replica ``dp``, in ring order."""
        base = dp * self.sp_size
        return tuple(base + r * self.ulysses_degree + u for r in range(self.ring_size))

    def check_seq_len(self, seq_len: int) -> None:
        """Every rank holds 2 of 2P equal pieces of a sequence: N must be divisible by 2P."""
        if seq_len % (2 * self.sp_size):
            lo = seq_len - seq_len % (2 * self.sp_size)
            raise ValueError(
                f"sequence length {seq_len} is not divisible by 2 x sequence_parallel_size = {2 * self.sp_size}: "
                f"pad to {lo + 2 * self.sp_size}" + (f" or truncate to {lo}" if lo else "")
            )

    def describe(self) -> str:
        s = (
            f"ds_wallfacer: mode={self.mode} world={self.world_size} data_parallel={self.dp_size} "
            f"sequence_parallel={self.sp_size} ulysses_degree={self.ulysses_degree} ring_size={self.ring_size} "
            f"ring_count={self.ring_count} sharding={self.sharding} kernel={self.kernel}"
        )
        return "\n".join([s, *(f"ds_wallfacer: auto: {n}" for n in self.notes)])


def _ranks_per_node(cfg: WallFacerConfig, world_size: int, given: int | None) -> int | None:
    if cfg.ranks_per_node != "auto":
        return int(cfg.ranks_per_node)
    if given is not None:
        return given
    env = os.environ.get("LOCAL_WORLD_SIZE")
    return int(env) if env and env.isdigit() and int(env) > 0 else None


def resolve_auto(
    cfg: WallFacerConfig,
    *,
    world_size: int,
    num_heads: int,
    num_kv_heads: int,
    ranks_per_node: int | None = None,
) -> ParallelLayout:
    """Resolve every "auto" of ``cfg`` and validate: the single plug-in point for the topology planner.

    Until the planner lands, "auto" picks a safe valid value: P = world size; U = 1 (wallfacer), P (ulysses)
    or, for hybrid, the largest valid degree below P that fits in a node; C = the largest valid ring count
    whose team fits in a node. Every choice is recorded in ``ParallelLayout.notes``.
    """
    notes: list[str] = []
    rpn = _ranks_per_node(cfg, world_size, ranks_per_node)
    node = rpn or world_size
    p = world_size if cfg.sequence_parallel_size == "auto" else int(cfg.sequence_parallel_size)
    if cfg.sequence_parallel_size == "auto":
        notes.append(f"sequence_parallel_size = {p} (the world size)")

    if cfg.ulysses_degree != "auto":
        u = int(cfg.ulysses_degree)
    elif cfg.mode == "wallfacer":
        u = 1
    elif cfg.mode == "ulysses":
        u = p
        notes.append(f"ulysses_degree = {u} (mode ulysses: the whole sequence-parallel group)")
    else:
        fits = [d for d in valid_ulysses_degrees(p, num_heads, num_kv_heads) if d < p and node % d == 0] if p > 0 else []
        no_copy = [d for d in fits if num_kv_heads % d == 0]
        u = max(no_copy or fits or [1])
        notes.append(
            f"ulysses_degree = {u} (largest degree < P={p} that divides the heads ({num_heads} q / {num_kv_heads} kv)"
            f" and the {node} ranks of a node)"
        )

    if cfg.ring_count != "auto":
        c = int(cfg.ring_count)
    else:
        r = p // u if u and p % u == 0 else 1
        c = max(x for x in _ring_counts(r) if node % x == 0 or x == 1)
        if r > 1:
            notes.append(f"ring_count = {c} (largest C with C*C | {r} ring ranks whose team stays in a node)")

    return ParallelLayout(
        world_size=world_size,
        sp_size=p,
        mode=cfg.mode,
        ulysses_degree=u,
        ring_count=c,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        sharding=cfg.sharding,
        kernel=cfg.kernel,
        ranks_per_node=rpn,
        notes=tuple(notes),
    )
