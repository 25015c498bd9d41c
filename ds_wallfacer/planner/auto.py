"""From a parsed ``WallFacerConfig``, the world size and the model's heads to the ``ParallelSetup`` a run uses: the one
place where "auto" values are chosen, by the topology planner when it has a model and a sequence length, else (or
when the planner finds nothing) by the safe rule (``_safe_rule``). The sizes are ``comm.dims.ParallelDims``'s.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..comm.dims import Mode, ParallelDims, check_sp_size, divisors, splits_heads, valid_ulysses_degrees
from ..comm.layout import valid_ring_counts
from ..config.schema import RunConfig, WallFacerConfig
from ..data.chunks import check_divisible, padded_length

__all__ = ["ParallelSetup", "PlanInputs", "resolve_auto", "run_facts"]


@dataclass(frozen=True)
class ParallelSetup:
    """What the run does across ranks, the same on every rank: the validated sizes, the sharding, the kernel, and
    what "auto" chose and why."""

    dims: ParallelDims
    """World, data, sequence, Ulysses and ring sizes, ring count, placement, mode, heads; the rank arithmetic."""
    sharding: str = "zigzag"
    """Chunk layout over the ring dimension (``data.chunks.SHARDINGS``)."""
    kernel: str = "auto"
    """Block-attention kernel name."""
    ulysses_head_groups: int = 2
    """Head groups Ulysses alone pipelines its all-to-alls over (``UlyssesAttention.head_groups``)."""
    ranks_per_node: int | None = None
    """Ranks per node (None: unknown)."""
    notes: tuple[str, ...] = ()
    """What "auto" chose and why (logged at start-up)."""
    planner_choice: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    """The planner's choice (``PlanChoice.as_dict()`` plus cluster, model, seq_len) when it chose; for wandb."""

    def check_seq_len(self, seq_len: int) -> None:
        """Every rank holds 2 of 2P equal pieces of a sequence: N must be divisible by 2P."""
        check_divisible(seq_len, self.dims.sp_size)

    def describe(self) -> str:
        d = self.dims
        s = (
            f"ds_wallfacer: mode={d.mode} world={d.world_size} data_parallel={d.dp_size} "
            f"sequence_parallel={d.sp_size} ulysses_degree={d.ulysses_degree} ring_size={d.ring_size} "
            f"ring_count={d.ring_count} placement={d.placement} sharding={self.sharding} kernel={self.kernel}"
        )
        return "\n".join([s, *(f"ds_wallfacer: auto: {n}" for n in self.notes)])

    def log_dict(self) -> dict[str, Any]:
        """Flat values for wandb's run config: the sizes, the notes and the planner's choice."""
        d = self.dims
        out: dict[str, Any] = {
            "wallfacer/mode": d.mode, "wallfacer/world_size": d.world_size,
            "wallfacer/sequence_parallel_size": d.sp_size, "wallfacer/data_parallel_size": d.dp_size,
            "wallfacer/ulysses_degree": d.ulysses_degree, "wallfacer/ring_count": d.ring_count,
            "wallfacer/placement": d.placement, "wallfacer/sharding": self.sharding,
            "wallfacer/kernel": self.kernel, "wallfacer/auto_notes": list(self.notes),
            "wallfacer/planner_used": self.planner_choice is not None,
        }
        return out | {f"wallfacer/planner/{k}": v for k, v in (self.planner_choice or {}).items()}


@dataclass(frozen=True)
class PlanInputs:
    """What the topology planner needs beyond the ``"wallfacer"`` section (``initialize`` gathers it)."""

    model: Any
    """The HF model config (object or dict), a ``planner.ModelSpec`` or a model preset name."""
    seq_len: int | None = None
    """Tokens per training sequence (``wallfacer.seq_len`` wins when set; None and unset: no plan)."""
    run: RunConfig | None = None
    """The parsed ds_config, for the run facts the planner reads (``run_facts``); None: a bf16 run of one sequence
    per micro-step, without ZeRO or offload."""
    reentrant_checkpointing: bool = False
    """transformers' layer checkpointing (outside Mini-Sequence) is reentrant; its default is not."""
    activation_checkpointing: bool = False
    """Decoder layers checkpointed outside Mini-Sequence (e.g. HF gradient checkpointing)."""
    default_cluster: str = "h100x64"
    """The preset whose hardware figures ``"cluster": "auto"`` means (``initialize`` picks it by accelerator)."""
    environ: Mapping[str, str] | None = None
    """Launch environment for ``planner.from_env`` and LOCAL_WORLD_SIZE (None: ``os.environ``)."""
    whole_heads: tuple[int, ...] = ()
    """Head counts of the model's layers that scan whole heads per rank (``Workload.whole_heads``)."""
    head_groups: tuple[int, ...] = ()
    """Group counts of its Mamba-2 mixers (``Workload.head_groups``)."""


def run_facts(run: RunConfig | None) -> dict[str, Any]:
    """What the ds_config fixes about a run, as ``planner.Workload`` takes it: sequences per micro-step, element
    size, ZeRO stage and offloads, read through ``RunConfig``'s properties (the one place that reads them from the
    JSON). Without a ds_config: one bf16 sequence per micro-step, no ZeRO, no offload."""
    if run is None:
        return dict(batch=1, elem_bytes=2, zero_stage=0, offload_optimizer=False, offload_params=False,
                    offload_checkpoints=False)
    return dict(batch=run.micro_batch_size or 1, elem_bytes=run.elem_bytes, zero_stage=run.zero_stage,
                offload_optimizer=run.offload_optimizer, offload_params=run.offload_params,
                offload_checkpoints=run.cpu_checkpointing)


def _ranks_per_node(cfg: WallFacerConfig, given: int | None, environ: Mapping[str, str]) -> int | None:
    if cfg.ranks_per_node != "auto":
        return int(cfg.ranks_per_node)
    if given is not None:
        return given
    env = environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE")  # torchrun's, the deepspeed launcher's
    return int(env) if env and env.isdigit() and int(env) > 0 else None


def _open_keys(cfg: WallFacerConfig) -> list[str]:
    """The planner's choices that ``cfg`` leaves open ("auto" that is not already implied by the mode)."""
    mode = cfg.fixed_mode
    keys = []
    if mode is None:
        keys.append("mode")
    if cfg.sequence_parallel_size == "auto":
        keys.append("sequence_parallel_size")
    if cfg.ulysses_degree == "auto" and (mode is None or mode.has_ring and mode.has_ulysses):
        keys.append("ulysses_degree")
    if cfg.ring_count == "auto" and (mode is None or mode.has_ring):
        keys.append("ring_count")
    if cfg.placement == "auto" and (mode is None or mode.has_ring):
        keys.append("placement")
    if keys == ["placement"] and not _placement_matters(cfg):
        keys = []
    return keys


def _placement_matters(cfg: WallFacerConfig) -> bool:
    """With every size fixed (``cfg.fixed_mode`` set): whether the placement changes which ranks talk
    (``ParallelDims.placement_matters``); sizes that do not fit are the safe rule's to report."""
    p = int(cfg.sequence_parallel_size)
    u = cfg.fixed_mode.ulysses_degree(p) or int(cfg.ulysses_degree)
    try:
        return ParallelDims(world_size=p, sp_size=p, ulysses_degree=u, ring_count=int(cfg.ring_count)).placement_matters
    except ValueError:
        return False


def _check_sp_size(cfg: WallFacerConfig, *, world_size: int, num_heads: int, num_kv_heads: int,
                   rpn: int | None) -> None:
    """A fixed P that does not divide the world: the error lists the sizes that resolve with the other settings as
    given (the safe rule tried on each divisor), so that every size it offers runs (an explicit ring_count or
    ulysses_degree rules some divisors out)."""
    if cfg.sequence_parallel_size == "auto":
        return
    p = int(cfg.sequence_parallel_size)
    if p >= 1 and world_size % p == 0:
        return
    ok = []
    for d in divisors(world_size):
        try:
            _safe_rule(replace(cfg, sequence_parallel_size=d), world_size=world_size, num_heads=num_heads,
                       num_kv_heads=num_kv_heads, rpn=rpn, notes=[])
        except ValueError:
            continue
        ok.append(d)
    check_sp_size(world_size, p, valid=ok)


def resolve_auto(
    cfg: WallFacerConfig,
    *,
    world_size: int,
    num_heads: int,
    num_kv_heads: int,
    ranks_per_node: int | None = None,
    planner_inputs: PlanInputs | None = None,
) -> ParallelSetup:
    """Resolve every "auto" of ``cfg`` and validate. Pure and deterministic (same result on every rank).

    With ``planner_inputs`` and a sequence length (``cfg.seq_len`` or ``planner_inputs.seq_len``), the topology
    planner chooses the open values (``ds_wallfacer.planner.resolve``) for the cluster (``cfg.cluster`` preset,
    launch shape from the environment), the model and the length; the user's values are passed to it as fixed. Otherwise, or when the
    planner raises ``PlanError``, the safe rule applies: P = world size; mode "auto" = wallfacer;
    U = 1 (wallfacer), P (ulysses) or, for hybrid, the largest valid degree below P that fits in a node;
    C = the largest valid ring count whose team fits in a node; placement team-inner. Every choice and the
    planner's reasons (or its error) are recorded in ``ParallelSetup.notes``.
    """
    environ = os.environ if planner_inputs is None or planner_inputs.environ is None else planner_inputs.environ
    rpn = _ranks_per_node(cfg, ranks_per_node, environ)
    notes: list[str] = []
    given = planner_inputs.seq_len if planner_inputs is not None else None
    if given is not None and cfg.seq_len is not None and given != cfg.seq_len:
        raise ValueError(f"wallfacer.seq_len = {cfg.seq_len} but the training sequences have {given} tokens "
                         f"(initialize(seq_len=...)): drop one or make them equal")
    _check_sp_size(cfg, world_size=world_size, num_heads=num_heads, num_kv_heads=num_kv_heads, rpn=rpn)
    open_keys = _open_keys(cfg)
    if world_size == 1:  # nothing to split or plan: one line, not the planner's "no configuration"
        notes.append("one rank: no sequence parallelism (attention over the whole sequence on this rank)")
        open_keys = []
    if planner_inputs is not None and open_keys:
        seq_len = cfg.seq_len or planner_inputs.seq_len
        if seq_len is None:
            notes.append("planner not used: no sequence length known (set wallfacer.seq_len or pass "
                         "initialize(seq_len=...)); the safe rule chose instead")
        else:
            setup = _planned(cfg, planner_inputs, seq_len, open_keys, world_size=world_size, num_heads=num_heads,
                            num_kv_heads=num_kv_heads, rpn=rpn, environ=environ, notes=notes)
            if setup is not None:
                return setup
    heads = (planner_inputs.whole_heads, planner_inputs.head_groups) if planner_inputs is not None else ((), ())
    setup = _safe_rule(cfg, world_size=world_size, num_heads=num_heads, num_kv_heads=num_kv_heads, rpn=rpn,
                      notes=notes, mixer_heads=heads)
    if world_size == 1:
        setup = replace(setup, notes=tuple(notes[:1]))
    seq_len = cfg.seq_len or (planner_inputs.seq_len if planner_inputs is not None else None)
    if planner_inputs is not None and not open_keys and seq_len is not None:
        # every size was set: the planner chooses nothing, but its prediction for these sizes is still worth
        # logging beside the measured step time (no note when it has none: the user's sizes stand either way)
        fixed = replace(cfg, ulysses_degree=setup.dims.ulysses_degree, placement=setup.dims.placement)
        predicted = _planned(fixed, planner_inputs, seq_len, [], world_size=world_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, rpn=rpn, environ=environ, notes=[])
        if predicted is not None:
            setup = replace(setup, planner_choice=predicted.planner_choice)
    return setup


def _planned(cfg: WallFacerConfig, inputs: PlanInputs, seq_len: int, open_keys: list[str], *, world_size: int,
             num_heads: int, num_kv_heads: int, rpn: int | None, environ: Mapping[str, str],
             notes: list[str]) -> ParallelSetup | None:
    """The planner's setup, or None (with the reason in ``notes``) when it has no plan."""
    from .. import planner as pl  # lazily: the search imports torch (byte formulas); this module stays pure

    base = pl.get_cluster(inputs.default_cluster if cfg.cluster == "auto" else cfg.cluster)  # bad name: error
    try:
        cluster = pl.from_env(base, environ)
        local = min(rpn, world_size) if rpn else None
        if local and world_size % local == 0:
            cluster = replace(cluster, nodes=world_size // local, ranks_per_node=local)
        else:
            cluster = cluster.with_world_size(world_size)
    except ValueError as e:
        notes.append(f"planner not used: the cluster does not fit {world_size} ranks ({e}); the safe rule chose "
                     "instead")
        return None
    # this device's measured compute (a cached micro-benchmark; measured once on CPU, read if cached on a GPU)
    cluster = pl.calibrated(cluster)
    ms = cfg.mini_sequence
    fixed = {
        "mode": cfg.fixed_mode,
        "sp_size": cfg.sequence_parallel_size,
        "ulysses_degree": cfg.ulysses_degree,
        "ring_count": cfg.ring_count,
        "placement": cfg.placement,
        # no "auto" for these in the config yet: what the run will do is fixed
        "mini_sequence": ms is not None,
        "mlp_chunk_tokens": ms.mlp_chunk_tokens if ms is not None and ms.mlp else None,
        "lm_head_chunk_tokens": ms.lm_head_chunk_tokens if ms is not None and ms.lm_head else None,
        "activation_checkpointing": inputs.activation_checkpointing
        or (ms is not None and ms.activation_checkpointing != "none"),
    }
    if fixed["activation_checkpointing"]:  # transformers' own checkpointing keeps attention's results too
        fixed["keep_attention"] = ms.keep_attention if ms is not None else True
        fixed["reentrant"] = (ms.activation_checkpointing == "deepspeed" if ms is not None
                              else inputs.reentrant_checkpointing)
    # the loader pads each sequence to a multiple of 2P; plan for a length every P <= world size accepts
    n = padded_length(seq_len, world_size)
    facts = run_facts(inputs.run)
    facts["offload_checkpoints"] |= ms is not None and ms.offload_checkpoints
    workload = pl.Workload(seq_len=n, whole_heads=inputs.whole_heads, head_groups=inputs.head_groups, **facts)
    model = pl.get_model(inputs.model)
    what = (f"cluster {cluster.name} ({cluster.nodes} x {cluster.ranks_per_node} ranks), model {model.name}, "
            f"seq_len {n}" + (f" (padded from {seq_len})" if n != seq_len else ""))
    try:
        choice = pl.resolve(cluster, model, n, world_size, fixed, workload=workload)
    except pl.PlanError as e:
        notes.append(f"planner found no configuration for {what}: {e}; the safe rule chose instead")
        return None
    values = {"mode": choice.mode, "sequence_parallel_size": choice.sp_size,
              "ulysses_degree": choice.ulysses_degree, "ring_count": choice.ring_count, "placement": choice.placement}
    if open_keys:
        chosen = ", ".join(f"{k} = {values[k]}" for k in open_keys)
        notes.append(f"planner chose {chosen} for {what}")
        notes.extend(f"planner: {r}" for r in choice.reasons)
    dims = ParallelDims(world_size=world_size, sp_size=choice.sp_size, ulysses_degree=choice.ulysses_degree,
                        ring_count=choice.ring_count, placement=choice.placement, mode=choice.mode,
                        num_heads=num_heads, num_kv_heads=num_kv_heads)
    return ParallelSetup(
        dims, sharding=cfg.sharding, kernel=cfg.kernel, ulysses_head_groups=cfg.ulysses_head_groups,
        ranks_per_node=rpn, notes=tuple(notes),
        planner_choice=choice.as_dict() | {"cluster": cluster.name, "model": model.name, "seq_len": n},
    )


def _safe_rule(cfg: WallFacerConfig, *, world_size: int, num_heads: int, num_kv_heads: int, rpn: int | None,
               notes: list[str], mixer_heads: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> ParallelSetup:
    """The safe rule: valid values that keep teams and Ulysses groups inside a node. ``mixer_heads``: the head and
    group counts of layers that scan whole heads per rank (``PlanInputs.whole_heads``, ``head_groups``)."""
    node = rpn or world_size
    p = world_size if cfg.sequence_parallel_size == "auto" else int(cfg.sequence_parallel_size)
    if cfg.sequence_parallel_size == "auto":
        p = max(d for d in divisors(world_size) if splits_heads(d, *mixer_heads))
        why = "the world size" if p == world_size else (
            f"the largest divisor of the world size over which the linear-attention / state-space heads "
            f"{list(mixer_heads[0])} (groups {list(mixer_heads[1])}) split")
        notes.append(f"sequence_parallel_size = {p} ({why})")
    mode = cfg.fixed_mode
    if mode is None:
        mode = Mode.WALLFACER
        notes.append(f"mode = {mode} (the default when nothing was planned)")

    if cfg.ulysses_degree != "auto":
        u = int(cfg.ulysses_degree)
    elif (implied := mode.ulysses_degree(p)) is not None:
        u = implied
        if mode.has_ulysses:
            notes.append(f"ulysses_degree = {u} (mode {mode}: the whole sequence-parallel group)")
    else:
        fits = [d for d in valid_ulysses_degrees(p, num_heads, num_kv_heads) if d < p and node % d == 0] if p > 0 else []
        no_copy = [d for d in fits if num_kv_heads % d == 0]
        u = max(no_copy or fits or [1])
        notes.append(
            f"ulysses_degree = {u} (largest degree < P={p} that divides the heads ({num_heads} q / {num_kv_heads} kv)"
            f" and the {node} ranks of a node)"
        )

    # the sizes with one ring first: R is read from them, then C is chosen over it
    dims = ParallelDims(world_size=world_size, sp_size=p, ulysses_degree=u, mode=mode,
                        placement="team-inner" if cfg.placement == "auto" else cfg.placement, num_heads=num_heads,
                        num_kv_heads=num_kv_heads)
    if cfg.ring_count != "auto":
        c = int(cfg.ring_count)
    else:
        r = dims.ring_size
        c = max(x for x in valid_ring_counts(r) if node % x == 0 or x == 1)
        if r > 1:
            notes.append(f"ring_count = {c} (largest C with C*C | {r} ring ranks whose team stays in a node)")
    dims = replace(dims, ring_count=c)
    return ParallelSetup(dims, sharding=cfg.sharding, kernel=cfg.kernel, ulysses_head_groups=cfg.ulysses_head_groups,
                         ranks_per_node=rpn, notes=tuple(notes))
