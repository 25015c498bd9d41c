"""Cost model: bytes, communication and compute time per layer and per training step of a candidate (``estimate``).

Byte volumes are ``attention.volume``'s exact counts of what the implementation sends; times come from the links
``placement.analyse_links`` finds for the candidate's rank placement.

Design: Note [Cost model] in docs/design.md §10 (the time formulas, what overlaps).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.volume import AttnShape, paper_ring_bytes, paper_wallfacer_bytes, ulysses_bytes, wallfacer_bytes
from .candidate import Candidate, Workload
from .cluster import ClusterSpec
from .model import ModelSpec
from .placement import Links, LinkStats, analyse_links, ring_offset

__all__ = ["CostBreakdown", "attention_shapes", "estimate", "kv_heads_on_wire", "layer_bytes", "paper_figures"]

_BWD_ATTN = 2.5
"""Backward / forward FLOPs of block attention (flash-attention: 5 matmuls vs 2)."""


def kv_heads_on_wire(model: ModelSpec, ulysses_degree: int, *, kv_replication: bool) -> int | None:
    """kv heads that the Ulysses all-to-all spreads over U ranks: the model's, or U when they are replicated
    (U a multiple of them); None when U is not allowed (U must divide the query heads)."""
    u, hk = ulysses_degree, model.kv_heads
    if model.heads % u:
        return None
    if hk % u == 0:
        return hk
    return u if kv_replication and u % hk == 0 else None


def attention_shapes(model: ModelSpec, cand: Candidate, workload: Workload) -> tuple[AttnShape, AttnShape | None]:
    """(full attention shape, the WallFacer shape over the R ring ranks: hq / U and hk / U heads per rank, kv
    heads replicated to U first when U is a multiple of them, as ``ulysses.py`` does)."""
    hk = kv_heads_on_wire(model, cand.ulysses_degree, kv_replication=workload.kv_replication)
    if hk is None:
        raise ValueError(f"Ulysses degree {cand.ulysses_degree} does not fit {model.heads} heads / {model.kv_heads} kv heads")
    full = AttnShape(workload.batch, workload.seq_len, model.heads, model.kv_heads, model.head_dim, workload.elem_bytes,
                     value_dim=model.value_head_dim)
    if cand.ring_size == 1:
        return full, None
    u = cand.ulysses_degree
    return full, AttnShape(workload.batch, workload.seq_len, model.heads // u, hk // u, model.head_dim,
                           workload.elem_bytes, value_dim=model.value_head_dim)


def layer_bytes(
    model: ModelSpec, cand: Candidate, workload: Workload, *, sp_index: int | None = None
) -> dict[str, dict[str, int]]:
    """Bytes a rank sends per layer (attention call), by phase and kind, as the implementation counts them:
    the rank at index ``sp_index`` of its SP group, or (None) the busiest one (a team member with local != 0
    also sends the skew)."""
    full, ring = attention_shapes(model, cand, workload)
    out: dict[str, dict[str, int]] = {"forward": {}, "backward": {}}
    if cand.ulysses_degree > 1:
        for phase, kinds in ulysses_bytes(full, degree=cand.ulysses_degree, sp_size=cand.sp_size).items():
            out[phase].update(kinds)
    if ring is not None:
        if sp_index is None:
            local = 1 if cand.ring_count > 1 else 0
        else:  # sp index = ring offset * U + u; the ring offset is the placement's image of the WallFacer index
            offs = [ring_offset(i, ring_size=cand.ring_size, ring_count=cand.ring_count, placement=cand.placement)
                    for i in range(cand.ring_size)]
            local = offs.index(sp_index // cand.ulysses_degree) % cand.ring_count
        wf = wallfacer_bytes(ring, sp_size=cand.ring_size, ring_count=cand.ring_count, local=local)
        for phase, kinds in wf.items():
            out[phase].update(kinds)
    return out


@dataclass(frozen=True)
class CostBreakdown:
    """Predicted per-rank figures of one training step (one micro-batch of ``batch`` sequences per SP group)."""

    fwd_bytes: dict[str, int]
    """Attention bytes sent per layer forward, by kind."""
    bwd_bytes: dict[str, int]
    step_bytes: int
    """Attention bytes sent per step: all layers, forward + backward + recomputed forward."""
    zero_bytes: int
    """ZeRO gradient / parameter traffic per step."""
    compute_s: float
    """Pure compute per step."""
    comm_s: float
    """Attention communication per step, all of it (before overlap)."""
    zero_s: float
    step_s: float
    """Predicted step time, overlap applied."""
    tokens_per_s: float
    """All data-parallel replicas together."""
    attn_layer_s: float
    """One layer's attention forward + backward (communication included, overlap applied)."""
    links: Links

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)


def _t(nbytes: float, link: LinkStats | None, messages: float) -> float:
    if nbytes <= 0 or link is None:
        return 0.0
    return nbytes / link.bw + messages * link.latency


@dataclass(frozen=True)
class _KernelTimes:
    """Pure compute of one layer's pieces on one rank (seconds), and of the LM head."""

    linear: float
    """q/k/v/o projections and the MLP, forward."""
    mlp: float
    """The MLP alone, forward (what MsT recomputes)."""
    attention: float
    """Attention forward over this rank's share of the score matrix."""
    head: float
    """LM head forward + backward."""


def _kernel_times(model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload) -> _KernelTimes:
    flops = cluster.flops * cluster.mfu
    b, n, s = workload.batch, workload.seq_len, workload.seq_len // cand.sp_size
    return _KernelTimes(
        linear=b * model.layer_matmul_flops(s) / flops,
        mlp=2.0 * b * s * model.mlp_matrices * model.hidden * model.intermediate / flops,
        # causal: half of QK^T (d) and PV (dv), 2 FLOPs per multiply-add
        attention=b * model.heads * (model.head_dim + model.value_head_dim) * n * n / cand.sp_size / flops,
        head=6.0 * b * s * model.hidden * model.vocab / flops,
    )


def _attention_time(
    kinds: dict[str, int], *, skew_fwd: int, attn: float, links: Links, cand: Candidate, workload: Workload,
    backward: bool,
) -> tuple[float, float]:
    """(wall time of one attention call, its communication time before overlap), from its bytes by kind."""
    c, g = cand.ring_count, cand.group_size
    a2a = _t(kinds.get("all_to_all", 0), links.a2a, 4)
    if cand.ring_size == 1:
        return a2a + attn, a2a
    coll = _t(kinds["all_gather"], links.team, (1 if backward else 2) * (c - 1))
    coll += _t(kinds["reduce_scatter"], links.team, c - 1)
    skew = _t(skew_fwd, links.skew, 1)
    if backward:
        skew += _t(kinds["skew"] - skew_fwd, links.home, 1)
    hop = _t(kinds["ring"] / (g - 1), links.ring, 1) if g > 1 else 0.0
    step = attn / g
    ring = (g - 1) * max(step, hop) + step if workload.overlap else g * step + (g - 1) * hop
    comm = a2a + coll + skew + (g - 1) * hop
    return a2a + coll + skew + ring, comm


def _zero_traffic(model: ModelSpec, cluster: ClusterSpec, workload: Workload) -> tuple[int, float]:
    """(bytes, seconds) of ZeRO's gradient reduce-scatter + parameter all-gather (+ one more gather per pass with
    stage 3) per step and rank."""
    w = cluster.world_size
    if w == 1:
        return 0, 0.0
    nbytes = int((2 if workload.zero_stage < 3 else 3) * workload.elem_bytes * model.params * (w - 1) / w)
    # NCCL runs one ring per NIC: the per-rank bytes cross each node boundary spread over all NICs
    bw = cluster.intra_bw if cluster.nodes == 1 else min(cluster.intra_bw, cluster.nic_bw * cluster.nics_per_node)
    return nbytes, nbytes / bw


def estimate(
    model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload, *, links: Links | None = None
) -> CostBreakdown:
    """Predict one training step of ``cand`` on ``cluster`` (``links``: a cached ``analyse_links`` result)."""
    links = links or analyse_links(cand, cluster)
    t = _kernel_times(model, cluster, cand, workload)
    by = layer_bytes(model, cand, workload)
    fb, bb = by["forward"], by["backward"]
    common = dict(skew_fwd=fb.get("skew", 0), links=links, cand=cand, workload=workload)
    fwd_attn, fwd_comm = _attention_time(fb, attn=t.attention, backward=False, **common)
    bwd_attn, bwd_comm = _attention_time(bb, attn=_BWD_ATTN * t.attention, backward=True, **common)
    layer_fwd = t.linear + fwd_attn

    # what backward runs again: the layer forward under checkpointing (attention too, unless its output is kept),
    # and the MLP under MsT
    recompute, re_comm, re_bytes, re_compute = 0.0, 0.0, 0, 0.0
    if cand.checkpointing:
        if not cand.keep_attention:
            recompute, re_comm, re_bytes, re_compute = layer_fwd, fwd_comm, sum(fb.values()), t.linear + t.attention
        else:
            recompute, re_compute = t.linear, t.linear
    if cand.mini_sequence:
        recompute += t.mlp
        re_compute += t.mlp

    layers = model.layers
    compute = layers * (3 * t.linear + (1 + _BWD_ATTN) * t.attention + re_compute) + t.head
    comm = layers * (fwd_comm + bwd_comm + re_comm)
    zero_bytes, zero_s = _zero_traffic(model, cluster, workload)
    bwd_total = layers * (2 * t.linear + bwd_attn)
    exposed_zero = max(0.0, zero_s - bwd_total) if workload.overlap else zero_s
    step = layers * (layer_fwd + bwd_attn + 2 * t.linear + recompute) + t.head + exposed_zero
    return CostBreakdown(
        fwd_bytes=dict(fb), bwd_bytes=dict(bb),
        step_bytes=layers * (sum(fb.values()) + sum(bb.values()) + re_bytes),
        zero_bytes=zero_bytes, compute_s=compute, comm_s=comm, zero_s=zero_s, step_s=step,
        tokens_per_s=(cluster.world_size // cand.sp_size) * workload.batch * workload.seq_len / step,
        attn_layer_s=fwd_attn + bwd_attn, links=links,
    )


def paper_figures(shape: AttnShape, *, sp_size: int, ring_count: int) -> dict[str, float]:
    """The paper's forward bytes per rank per layer (docs/design.md §2), three ways:

    - ``*_formula``: ``volume.paper_*_bytes``, (P-1) ring hops and (P/C^2 - 1) sub-ring hops
    - ``*_printed``: the figures as the paper prints them, which count P and P/C^2 hops (leading order);
      with Llama-30B, N = 64Ki, P = 64, C = 4 these are exactly 1.625, 0.15234 and 0.40625 GiB (2^30 bytes)
    - ``impl_*``: what our implementation sends (``volume.wallfacer_bytes``, busiest rank)
    """
    p, c = sp_size, ring_count
    g = p // (c * c)
    ring = paper_ring_bytes(shape, sp_size=p)
    wf = paper_wallfacer_bytes(shape, sp_size=p, ring_count=c)
    impl_ring = wallfacer_bytes(shape, sp_size=p, ring_count=1, local=0)["forward"]
    impl_wf = wallfacer_bytes(shape, sp_size=p, ring_count=c, local=1 if c > 1 else 0)["forward"]
    return {
        "ring_formula": ring,
        "collective_formula": wf["collective"],
        "wf_ring_formula": wf["ring"],
        "ring_printed": ring * p / (p - 1) if p > 1 else 0.0,
        "collective_printed": wf["collective"],
        "wf_ring_printed": wf["ring"] * g / (g - 1) if g > 1 else 0.0,
        "impl_ring": sum(impl_ring.values()),
        "impl_collective": impl_wf["all_gather"] + impl_wf["reduce_scatter"],
        "impl_skew": impl_wf["skew"],
        "impl_wf_ring": impl_wf["ring"],
    }
