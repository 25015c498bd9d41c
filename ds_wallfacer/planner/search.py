"""The planner: enumerate valid configurations, reject what does not fit memory, rank the rest.

``plan`` returns every row (ranked, rejected ones last with their reason); ``resolve`` is the start-up entry point
for ``"auto"`` values in the ``"wallfacer"`` config section: it respects the user's fixed values and chooses the
rest.

Design: Note [Ranking by throughput] and Note [Multi-ring only where it pays] in docs/design/planner.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping

from ..comm.layout import valid_ring_counts
from ..comm.dims import Mode, ParallelDims, Strategy, divisors
from ..data.chunks import padded_length, seq_len_divisor
from ..mst.config import auto_lm_head_chunk_tokens, auto_mlp_chunk_tokens
from .candidate import PLACEMENTS, STRATEGIES, Candidate, Workload
from .cluster import ClusterSpec, get_cluster
from .cost import CostBreakdown, estimate, kv_heads_on_wire
from .memory import GIB, MemoryBreakdown, memory_breakdown
from .model import ModelSpec, get_model
from .placement import analyse_links

__all__ = ["FIXED_KEYS", "Plan", "PlanChoice", "PlanError", "Row", "enumerate_candidates", "max_seq_len", "plan",
           "resolve"]

_RESOLUTION = 0.01
"""Predicted throughputs closer than this are not told apart (the model is not calibrated to better)."""

FIXED_KEYS = ("mode", "sp_size", "ring_count", "ulysses_degree", "placement", "mini_sequence", "mlp_chunk_tokens",
              "lm_head_chunk_tokens", "activation_checkpointing", "keep_attention", "reentrant")
"""Keys of ``fixed``: a value, or "auto" / None for the planner to choose."""


class PlanError(ValueError):
    """No configuration satisfies the request; ``suggestions`` name the nearest feasible settings."""

    def __init__(self, message: str, suggestions: Iterable[str] = ()) -> None:
        self.suggestions = tuple(suggestions)
        text = message + "".join(f"\n  - {s}" for s in self.suggestions)
        super().__init__(text)


@dataclass(frozen=True)
class Row:
    """One evaluated configuration."""

    candidate: Candidate
    memory: MemoryBreakdown
    cost: CostBreakdown
    reason: str = ""
    """Why it was rejected ("" when it fits)."""

    @property
    def fits(self) -> bool:
        return not self.reason

    def as_dict(self) -> dict[str, Any]:
        c, m, k = self.candidate, self.memory, self.cost
        return {
            "config": c.label, "strategy": c.strategy, "sp_size": c.sp_size, "ring_count": c.ring_count,
            "ulysses_degree": c.ulysses_degree, "placement": c.placement, "mini_sequence": c.mini_sequence,
            "mlp_chunk_tokens": c.mlp_chunk_tokens, "lm_head_chunk_tokens": c.lm_head_chunk_tokens,
            "activation_checkpointing": c.checkpointing, "keep_attention": c.keep_attention,
            "reentrant": c.reentrant, "fits": self.fits, "reason": self.reason,
            "comm_bytes_per_step": k.step_bytes, "layer_fwd_bytes": k.fwd_bytes, "layer_bwd_bytes": k.bwd_bytes,
            "comm_s": k.comm_s, "compute_s": k.compute_s, "zero_s": k.zero_s, "step_s": k.step_s,
            "tokens_per_s": k.tokens_per_s, "attn_layer_s": k.attn_layer_s, "memory_bytes": m.total, "memory_usable_bytes": m.usable,
            "exposed_comm_s": k.exposed_comm_s, "overhead_s": k.overhead_s, "optimizer_s": k.optimizer_s,
            "oversubscription": k.oversubscription, "calibrated": k.ops > 0,
            "links": k.links.describe(),
        }


@dataclass(frozen=True)
class PlanChoice:
    """The chosen configuration, in the ``"wallfacer"`` config vocabulary, with the reasons."""

    strategy: Strategy
    """What runs across ranks; ``mode`` is the config's word for it."""
    sp_size: int
    dp_size: int
    ring_count: int
    ulysses_degree: int
    placement: str
    mini_sequence: bool
    mlp_chunk_tokens: int
    lm_head_chunk_tokens: int
    activation_checkpointing: bool
    keep_attention: bool
    reentrant: bool
    step_s: float
    tokens_per_s: float
    memory_bytes: float
    reasons: tuple[str, ...]
    candidate: Candidate = field(repr=False)

    @property
    def mode(self) -> Mode:
        """The ``"wallfacer"`` config section's mode (``Strategy.mode``)."""
        return self.strategy.mode

    def as_dict(self) -> dict[str, Any]:
        """Flat values for logs and wandb (``planner/...`` keys are the caller's business)."""
        d = {k: v for k, v in vars(self).items() if k != "candidate"}
        return d | {"mode": self.mode, "reasons": list(self.reasons)}


@dataclass(frozen=True)
class Plan:
    cluster: ClusterSpec
    model: ModelSpec
    workload: Workload
    rows: tuple[Row, ...]
    """Fitting rows by predicted throughput, then rejected rows by memory."""
    skipped: tuple[str, ...]
    """Settings that are not valid at all here (head caps, divisibility), one line each."""
    choice: PlanChoice

    def as_dict(self) -> dict[str, Any]:
        return {
            "cluster": vars(self.cluster), "model": vars(self.model), "workload": vars(self.workload),
            "choice": self.choice.as_dict(), "rows": [r.as_dict() for r in self.rows], "skipped": list(self.skipped),
        }


def _free(fixed: Mapping[str, Any], key: str) -> bool:
    return fixed.get(key) in (None, "auto")


def _check_fixed(fixed: Mapping[str, Any]) -> None:
    unknown = sorted(set(fixed) - set(FIXED_KEYS))
    if unknown:
        raise ValueError(f"planner: unknown fixed key(s) {unknown}; allowed are {list(FIXED_KEYS)}")
    mode = fixed.get("mode")
    if not _free(fixed, "mode") and mode not in STRATEGIES:
        raise ValueError(f"planner: mode={mode!r}; expected one of {STRATEGIES} or 'auto'")
    if not _free(fixed, "placement") and fixed["placement"] not in PLACEMENTS:
        raise ValueError(f"planner: placement={fixed['placement']!r}; expected one of {PLACEMENTS} or 'auto'")


def _mini_sequence_options(
    model: ModelSpec, workload: Workload, fixed: Mapping[str, Any]
) -> tuple[list[bool], list[bool], int, int]:
    """(MsT on/off options, checkpointing options, MLP chunk tokens, LM-head chunk tokens) that ``fixed`` allows."""
    mst_opts = [True, False] if _free(fixed, "mini_sequence") else [bool(fixed["mini_sequence"])]
    if not (_free(fixed, "mlp_chunk_tokens") and _free(fixed, "lm_head_chunk_tokens")) and _free(fixed, "mini_sequence"):
        mst_opts = [True]  # a chunk size implies MsT on
    ac_opts = [True, False] if _free(fixed, "activation_checkpointing") else [bool(fixed["activation_checkpointing"])]
    mlp_chunk = auto_mlp_chunk_tokens(model.hidden) if _free(fixed, "mlp_chunk_tokens") else int(fixed["mlp_chunk_tokens"])
    head_chunk = (auto_lm_head_chunk_tokens(model.vocab, workload.lm_head_budget_mib) if _free(fixed, "lm_head_chunk_tokens")
                  else int(fixed["lm_head_chunk_tokens"]))
    return mst_opts, ac_opts, mlp_chunk, head_chunk


def _sequence_splits(
    model: ModelSpec, world_size: int, workload: Workload, fixed: Mapping[str, Any], skipped: list[str]
) -> Iterable[tuple[int, int]]:
    """(P, U) pairs that divide the world, fit the heads and the sequence length; why others do not goes to
    ``skipped`` (reported for the whole world only, where a user would look for it)."""
    n = workload.seq_len
    for p in divisors(world_size):
        if not _free(fixed, "sp_size") and p != fixed["sp_size"]:
            continue
        if not workload.splits_heads(p):
            if p == world_size:
                skipped.append(f"P={p}: the linear-attention / state-space heads {list(workload.whole_heads)} (groups "
                               f"{list(workload.head_groups)}) do not split over {p} ranks")
            continue
        for u in divisors(p):
            if not _free(fixed, "ulysses_degree") and u != fixed["ulysses_degree"]:
                continue
            if u > 1 and kv_heads_on_wire(model, u, kv_replication=workload.kv_replication) is None:
                if p == world_size:
                    why = (f"{model.heads} query heads" if model.heads % u else
                           f"{model.kv_heads} kv heads" + ("" if workload.kv_replication else " (kv replication off)"))
                    skipped.append(f"Ulysses U={u}: does not divide {why}")
                continue
            if n % seq_len_divisor(p):
                if p == world_size:
                    skipped.append(f"P={p} U={u}: seq_len {n} not divisible by {seq_len_divisor(p)}")
                continue
            yield p, u


def _ring_splits(sp_size: int, ulysses_degree: int, fixed: Mapping[str, Any]) -> Iterable[tuple[int, str]]:
    """(C, placement) pairs for P ranks with Ulysses degree U; placements that give the same ranks as team-inner
    are left out."""
    base = ParallelDims(world_size=sp_size, sp_size=sp_size, ulysses_degree=ulysses_degree)
    for c in valid_ring_counts(base.ring_size):
        if not _free(fixed, "ring_count") and c != fixed["ring_count"]:
            continue
        same_ranks = not replace(base, ring_count=c).placement_matters
        for pl in PLACEMENTS:
            if not _free(fixed, "placement") and pl != fixed["placement"]:
                continue
            if pl != "team-inner" and same_ranks and _free(fixed, "placement"):
                continue  # the same ranks as team-inner
            yield c, pl


def enumerate_candidates(
    model: ModelSpec, cluster: ClusterSpec, workload: Workload, fixed: Mapping[str, Any] | None = None
) -> tuple[list[Candidate], list[str]]:
    """Every valid candidate for the world size that respects ``fixed``, and why other settings are invalid."""
    fixed = dict(fixed or {})
    _check_fixed(fixed)
    skipped: list[str] = []
    out: list[Candidate] = []
    mst_opts, ac_opts, mlp_chunk, head_chunk = _mini_sequence_options(model, workload, fixed)
    keep_opts = [True, False] if _free(fixed, "keep_attention") else [bool(fixed["keep_attention"])]
    reentrant_opts = [True, False] if _free(fixed, "reentrant") else [bool(fixed["reentrant"])]
    ckpt_opts = [(k, r) for k in keep_opts for r in reentrant_opts]
    for p, u in _sequence_splits(model, cluster.world_size, workload, fixed, skipped):
        for c, pl in _ring_splits(p, u, fixed):
            for mst in mst_opts:
                for ac in ac_opts:
                    for keep, reentrant in (ckpt_opts if ac else [(True, True)]):
                        cand = Candidate(sp_size=p, ring_count=c, ulysses_degree=u, placement=pl, mini_sequence=mst,
                                         mlp_chunk_tokens=mlp_chunk if mst else 0,
                                         lm_head_chunk_tokens=head_chunk if mst else 0, checkpointing=ac,
                                         keep_attention=keep, reentrant=reentrant)
                        if _free(fixed, "mode") or cand.strategy.allowed_by(fixed["mode"]):
                            out.append(cand)
    return out, skipped


def _evaluate(model: ModelSpec, cluster: ClusterSpec, workload: Workload, cands: list[Candidate], *,
              dedupe: bool) -> list[Row]:
    links: dict[tuple, Any] = {}
    rows = []
    for cand in cands:
        key = (cand.sp_size, cand.ulysses_degree, cand.ring_count, cand.placement)
        if key not in links:
            links[key] = analyse_links(cand, cluster)
        if dedupe and cand.placement != "team-inner" and links[key] == links.get(key[:3] + ("team-inner",)):
            continue  # another placement with the same links: the same predictions
        mem = memory_breakdown(model, cluster, cand, workload)
        cost = estimate(model, cluster, cand, workload, links=links[key])
        reason = "" if mem.fits else (
            f"out of memory: needs {mem.total / GIB:.1f} GiB > {mem.usable / GIB:.1f} GiB usable "
            f"(largest: {mem.largest()} {getattr(mem, mem.largest()) / GIB:.1f} GiB)")
        rows.append(Row(cand, mem, cost, reason))
    return rows


def _ring_twin(row: Row, rows: list[Row]) -> Row | None:
    """The fitting C = 1 row with ``row``'s other settings (sizes, MsT, checkpointing), if any."""
    c = row.candidate
    for r in rows:
        t = r.candidate
        if (t.ring_count == 1 and t.sp_size == c.sp_size and t.ulysses_degree == c.ulysses_degree
                and t.mini_sequence == c.mini_sequence and t.checkpointing == c.checkpointing
                and t.mlp_chunk_tokens == c.mlp_chunk_tokens and t.lm_head_chunk_tokens == c.lm_head_chunk_tokens):
            return r
    return None


def _bytes_vs_ring(fitting: list[Row]) -> tuple[list[Row], str | None]:
    """Note [Multi-ring only where it pays]: ``fitting`` with the ring twin of the fastest row first when that row
    is multi-ring, sends more attention bytes than its twin and is not predicted faster beyond ``_RESOLUTION``;
    and the reason to report about the multi-ring choice (None when the best is not multi-ring or has no twin)."""
    best = fitting[0]
    if best.candidate.ring_count == 1:
        return fitting, None
    twin = _ring_twin(best, fitting)
    if twin is None:
        return fitting, f"{best.candidate.label}: no ring split with the same settings fits, so bytes were not compared"
    ratio = best.cost.step_bytes / max(twin.cost.step_bytes, 1)
    gain = twin.cost.step_s / best.cost.step_s - 1
    if ratio <= 1:
        return fitting, (f"C = {best.candidate.ring_count} sends {ratio:.2f}x the attention bytes of ring over the "
                         f"same ranks ({twin.candidate.label})")
    if gain > _RESOLUTION:
        return fitting, (f"C = {best.candidate.ring_count} sends {ratio:.2f}x the attention bytes of ring over the "
                         f"same ranks ({twin.candidate.label}) but its step is predicted {gain:.1%} shorter on these "
                         "links")
    rest = [r for r in fitting if r is not twin]
    return [twin] + rest, (f"ring chosen over {best.candidate.label}: that multi-ring split sends {ratio:.2f}x ring's "
                           f"attention bytes and its step is predicted only {gain:.1%} shorter, within the model's "
                           f"{_RESOLUTION:.0%} resolution")


def _rank_key(row: Row) -> tuple:
    c = row.candidate
    # ties: prefer ring traffic inside nodes, then the simpler setting
    return (-row.cost.tokens_per_s, c.placement != "team-inner", c.mini_sequence, c.checkpointing, not c.keep_attention,
            not c.reentrant)


def plan(
    cluster: ClusterSpec | str, model: ModelSpec | str | Mapping[str, Any] | Any, seq_len: int, *,
    world_size: int | None = None, fixed: Mapping[str, Any] | None = None, workload: Workload | None = None,
) -> Plan:
    """Evaluate every configuration for ``seq_len`` tokens; raise ``PlanError`` when none is valid or fits."""
    cluster = get_cluster(cluster)
    if world_size is not None:
        cluster = cluster.with_world_size(world_size)
    model = get_model(model)
    workload = replace(workload, seq_len=seq_len) if workload else Workload(seq_len=seq_len)
    fixed = {k: v for k, v in (fixed or {}).items() if v not in (None, "auto")}
    cands, skipped = enumerate_candidates(model, cluster, workload, fixed)
    if not cands:
        raise PlanError(f"no valid configuration for {_request(cluster, model, workload, fixed)}",
                        _nearest_valid(model, cluster, workload, fixed, skipped))
    rows = _evaluate(model, cluster, workload, cands, dedupe="placement" not in fixed)
    fitting = sorted((r for r in rows if r.fits), key=_rank_key)
    rejected = sorted((r for r in rows if not r.fits), key=lambda r: r.memory.total)
    if not fitting:
        raise PlanError(
            f"nothing fits in memory for {_request(cluster, model, workload, fixed)}: the leanest configuration "
            f"({rejected[0].candidate.label}) needs {rejected[0].memory.total / GIB:.1f} GiB per rank, "
            f"{rejected[0].memory.usable / GIB:.1f} GiB usable ({rejected[0].memory.describe()})",
            _nearest_fitting(model, cluster, workload, fixed),
        )
    fitting, bytes_note = _bytes_vs_ring(fitting)
    choice = _choose(fitting, rejected, fixed, cluster, bytes_note)
    return Plan(cluster, model, workload, tuple(fitting + rejected), tuple(skipped), choice)


def resolve(
    cluster: ClusterSpec | str, model: ModelSpec | str | Mapping[str, Any] | Any, seq_len: int,
    world_size: int | None = None, fixed: Mapping[str, Any] | None = None, *, workload: Workload | None = None,
) -> PlanChoice:
    """Start-up entry point: choose the "auto" values of the ``"wallfacer"`` section.

    ``fixed`` maps ``FIXED_KEYS`` to the user's values ("auto" / None / absent: the planner chooses). Returns
    the best fitting ``PlanChoice`` (its ``reasons`` and ``as_dict()`` are meant for the log and wandb); raises
    ``PlanError`` naming the nearest feasible settings. Pure and fast (well under a second up to 1024 ranks).
    """
    return plan(cluster, model, seq_len, world_size=world_size, fixed=fixed, workload=workload).choice


# -- explanations --------------------------------------------------------------------------------------


def _request(cluster: ClusterSpec, model: ModelSpec, workload: Workload, fixed: Mapping[str, Any]) -> str:
    given = ", ".join(f"{k}={v}" for k, v in fixed.items())
    return (f"{model.name} at seq_len {workload.seq_len} on {cluster.world_size} ranks ({cluster.name}, "
            f"{cluster.ranks_per_node}/node)" + (f" with {given}" if given else ""))


def _choose(fitting: list[Row], rejected: list[Row], fixed: Mapping[str, Any], cluster: ClusterSpec,
            bytes_note: str | None = None) -> PlanChoice:
    best = fitting[0]
    c, k = best.candidate, best.cost
    fastest = max(fitting, key=lambda r: r.cost.tokens_per_s) is best
    reasons = [f"{'fastest' if fastest else 'chosen'} of {len(fitting)} fitting configurations ({len(rejected)} "
               f"rejected for memory): {k.step_s * 1e3:.1f} ms/step, {k.tokens_per_s:,.0f} tokens/s, "
               f"{best.memory.total / GIB:.1f} GiB/rank"]
    if bytes_note:
        reasons.append(bytes_note)
    close = [r for r in fitting[1:] if r.cost.tokens_per_s >= 0.99 * k.tokens_per_s]
    if close:
        reasons.append(f"{len(close)} other configurations within 1% (below the model's accuracy), e.g. "
                       + "; ".join(r.candidate.label for r in close[:3]))
    for strategy in (s for s in Strategy if s.splits_sequence):
        other = next((r for r in fitting if r.candidate.strategy == strategy), None)
        if other is not None and other is not best and strategy != c.strategy:
            reasons.append(f"{k.tokens_per_s / other.cost.tokens_per_s:.2f}x the best {strategy} ({other.candidate.label})")
        elif other is None and any(r.candidate.strategy == strategy for r in rejected):
            reasons.append(f"every {strategy} configuration runs out of memory")
    if k.links.describe():
        reasons.append(f"placement {c.placement}: {k.links.describe()} ({cluster.ranks_per_node} ranks/node)")
    smaller = [r for r in rejected if r.candidate.sp_size < c.sp_size]
    if c.sp_size > 1 and smaller and _free(fixed, "sp_size"):
        reasons.append(f"SP size {c.sp_size} (data parallel {cluster.world_size // c.sp_size}): smaller SP groups "
                       "run out of memory or are slower")
    if c.checkpointing and _free(fixed, "keep_attention") and not c.keep_attention:
        reasons.append("attention recomputed in backward: its kept results do not fit")
    if c.checkpointing and _free(fixed, "reentrant") and not c.reentrant:
        reasons.append('torch\'s non-reentrant checkpointing (activation_checkpointing "torch"): DeepSpeed\'s '
                       "holds one more layer output in backward and does not fit")
    if _free(fixed, "mini_sequence"):
        reasons.append("MsT on: needed to fit, or no slower here" if c.mini_sequence else
                       "MsT off: fits without it and saves the MLP recomputation")
    given = [f"{key}={v}" for key, v in fixed.items()]
    if given:
        reasons.append("fixed by the user: " + ", ".join(given))
    return PlanChoice(
        strategy=c.strategy, sp_size=c.sp_size, dp_size=cluster.world_size // c.sp_size, ring_count=c.ring_count,
        ulysses_degree=c.ulysses_degree, placement=c.placement, mini_sequence=c.mini_sequence,
        mlp_chunk_tokens=c.mlp_chunk_tokens, lm_head_chunk_tokens=c.lm_head_chunk_tokens,
        activation_checkpointing=c.checkpointing, keep_attention=c.keep_attention, reentrant=c.reentrant,
        step_s=k.step_s, tokens_per_s=k.tokens_per_s,
        memory_bytes=best.memory.total, reasons=tuple(reasons), candidate=c,
    )


def _nearest(values: Iterable[int], target: int, k: int = 4) -> list[int]:
    return sorted(sorted(set(values), key=lambda v: (abs(v - target), v))[:k])


def _nearest_valid(model: ModelSpec, cluster: ClusterSpec, workload: Workload, fixed: Mapping[str, Any],
                   skipped: list[str]) -> list[str]:
    """For each fixed value, the values of that key that would be valid with the others kept."""
    out = list(dict.fromkeys(skipped))[:6]
    for key in ("sp_size", "ring_count", "ulysses_degree", "mode", "placement"):
        if key not in fixed:
            continue
        rest = {k: v for k, v in fixed.items() if k != key}
        cands, _ = enumerate_candidates(model, cluster, workload, rest)
        values = sorted({getattr(c, key) if key != "mode" else c.strategy for c in cands}, key=str)
        if values:
            shown = _nearest(values, fixed[key]) if isinstance(fixed[key], int) else values
            out.append(f"{key}={fixed[key]!r} is not possible here; feasible {key} values: {shown}")
    w = cluster.world_size
    n = workload.seq_len
    step = cluster.ranks_per_node if cluster.nodes > 1 else 1
    worlds = [x for x in range(step, 4 * w + 1, step) if x != w and x >= 1]
    ok_worlds = [x for x in worlds if enumerate_candidates(model, cluster.with_world_size(x), workload, fixed)[0]]
    if ok_worlds:
        out.append(f"world sizes where {dict(fixed)} is valid: {_nearest(ok_worlds, w)}")
    p = fixed.get("sp_size", w)
    if isinstance(p, int) and n % seq_len_divisor(p):
        lo = n - n % seq_len_divisor(p)
        out.append(f"seq_len must be a multiple of 2*P = {seq_len_divisor(p)}: use {padded_length(n, p)}"
                   + (f" or {lo}" if lo else ""))
    return out or [f"no setting of {dict(fixed)} is valid at world size {w}: drop the fixed values"]


def _fits_any(model: ModelSpec, cluster: ClusterSpec, workload: Workload, fixed: Mapping[str, Any]) -> bool:
    cands, _ = enumerate_candidates(model, cluster, workload, fixed)
    return any(memory_breakdown(model, cluster, c, workload).fits for c in cands)


def max_seq_len(model: ModelSpec, cluster: ClusterSpec, workload: Workload, fixed: Mapping[str, Any] | None = None,
                *, below: int = 1 << 26) -> int:
    """The longest sequence (a multiple of 2W tokens, valid for every SP size; at most ``below``) for which some
    configuration allowed by ``fixed`` fits memory, by bisection over the memory model; 0 when none does."""
    fixed = dict(fixed or {})
    unit = 2 * cluster.world_size
    lo, hi = 0, below // unit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits_any(model, cluster, replace(workload, seq_len=mid * unit), fixed):
            lo = mid
        else:
            hi = mid - 1
    return lo * unit


def _nearest_fitting(model: ModelSpec, cluster: ClusterSpec, workload: Workload, fixed: Mapping[str, Any]) -> list[str]:
    """The longest sequence that fits at this world size, and the smallest world size that fits this one."""
    out = []
    w, n = cluster.world_size, workload.seq_len
    longest = max_seq_len(model, cluster, workload, fixed, below=n)
    if longest:
        out.append(f"seq_len <= {longest} fits on these {w} ranks")
    step = cluster.ranks_per_node if cluster.nodes > 1 else 1
    for x in (w * 2**k for k in range(1, 7)):
        x = -(-x // step) * step
        if n % (2 * x) == 0 or n % x == 0:
            if _fits_any(model, cluster.with_world_size(x), workload, fixed):
                out.append(f"{x} ranks ({x // cluster.ranks_per_node if cluster.nodes > 1 else 1} nodes) fit "
                           f"seq_len {n}")
                break
    off = [name for name, on in (("--offload-optimizer", workload.offload_optimizer),
                                  ("--offload-checkpoints", workload.offload_checkpoints),
                                  ("--offload-params", workload.offload_params or workload.zero_stage < 3)) if not on]
    if off:
        out.append(f"offloading to the host ({', '.join(off)}) lowers the need")
    if fixed:
        out.append(f"or drop the fixed values {dict(fixed)}")
    return out
