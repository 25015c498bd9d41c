"""Cost model: bytes, communication and compute time per layer and per training step of a candidate (``estimate``).

Byte volumes are ``attention.volume``'s exact counts of what the implementation sends; times come from the links
``placement.analyse_links`` finds for the candidate's rank placement.

Design: Note [Cost model] in docs/design/planner.md (the time formulas, what overlaps).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.volume import AttnShape, paper_ring_bytes, paper_wallfacer_bytes, ulysses_bytes, wallfacer_bytes
from .candidate import Candidate, Workload
from .cluster import ClusterSpec
from .model import ModelSpec
from .placement import Links, LinkStats, analyse_links

__all__ = [
    "CostBreakdown", "attention_shapes", "collective_calls", "estimate", "forward_s", "kernel_calls", "kv_heads_on_wire",
    "layer_bytes", "oversubscription", "paper_figures",
]

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
            local = cand.dims.ring_order.index(sp_index // cand.ulysses_degree) % cand.ring_count
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
    """Arithmetic per step: matmuls and attention kernels at the device's rate (measured, or peak x MFU)."""
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
    exposed_comm_s: float = 0.0
    """Communication per step that nothing hides: attention's exposed part, ZeRO's beyond the backward, and the
    per-collective latencies of the other collectives the step makes (loss, data check, ZeRO)."""
    overhead_s: float = 0.0
    """Per-call overhead per step: op calls x the measured time of a tiny call, plus the memory-bound elementwise
    bytes at the measured bandwidth (0 without a calibration)."""
    optimizer_s: float = 0.0
    """The optimizer step over this rank's parameter shard (0 without a calibration)."""
    ops: float = 0.0
    """Op calls per step that ``overhead_s`` counts."""
    oversubscription: float = 1.0
    """Ranks x threads per core of the node (> 1: ranks share cores, their busy time stretches by this)."""
    detail: dict[str, float] | None = None
    """Named terms of ``step_s`` (seconds) for reports."""


def _t(nbytes: float, link: LinkStats | None, messages: float) -> float:
    if nbytes <= 0 or link is None:
        return 0.0
    return nbytes / link.bw + messages * link.latency


# Op calls (each costing the calibration's ``op_s``, a tiny autograd op forward + backward) that the runtime makes
# besides its arithmetic, per piece; rough counts of the HF Llama layer and our wrappers as implemented (norms,
# projections, rotary embedding, residuals, the attention function's reshapes and merges), in forward-op units:
# a backward costs _BWD_OPS forward units. Read from the code and its profile on the main job (docs/design/planner.md).
_OPS_LAYER = 120
"""One decoder layer's forward outside attention and the MLP: two norms, four projections, rotary, residuals,
checkpointing wrappers."""
_OPS_ATTN_CALL = 60
"""One attention call's wrapper: layouts, sharding, the output's merge."""
_OPS_BLOCK = 12
"""One block-kernel call: the kernel and the online-softmax merge of its result."""
_OPS_COLLECTIVE = 15
"""One collective: packing, contiguous copies, unpacking."""
_OPS_MLP_CHUNK = 12
"""One MLP mini-sequence (gate, up, activation, product, down; chunk and concatenate)."""
_OPS_HEAD_CHUNK = 25
"""One LM-head mini-sequence (projection, cross-entropy, its gradient by hand)."""
_OPS_STEP = 400
"""Per step: the engine's forward / backward / step entry points, the loss, data placement, logging."""
_OPS_PARAM = 20
"""Per parameter tensor: gradient hooks, ZeRO's bucket copies, clipping, the optimizer's bookkeeping."""
_BWD_OPS = 1.5
_STEP_COLLECTIVES = 3
"""Collectives of a step outside the layers (ZeRO >= 1 over W > 1 ranks): the gradient reduce, the gradient-norm
all-reduce, the updated parameters' all-gather."""
_LOSS_COLLECTIVES = 2
"""The global token-mean loss: its count and sum across the sequence-parallel group."""


@dataclass(frozen=True)
class _KernelTimes:
    """Pure compute of one layer's pieces on one rank (seconds), and of the LM head."""

    linear: float
    """q/k/v/o projections and the MLP, forward."""
    mlp: float
    """The MLP alone, forward (what MsT recomputes)."""
    attention: float
    """Attention forward over this rank's share of the score matrix."""
    attention_bwd: float
    """Attention backward."""
    head: float
    """LM head forward + backward."""


def _chunks(tokens: int, chunk: int) -> int:
    return max(1, -(-tokens // chunk)) if chunk > 0 else 1


def kernel_calls(cand: Candidate) -> int:
    """Block-kernel calls of one attention forward on one rank (the backward makes as many): Ulysses one over its
    whole sequence; ring and WallFacer one per sub-ring step, two per remote step with zigzag halves."""
    if cand.ring_size == 1:
        return 1
    g = cand.group_size
    return 1 + 2 * (g - 1) + (cand.ring_count - 1) if cand.ring_count > 1 else 1 + 2 * (g - 1)


def collective_calls(cand: Candidate, *, backward: bool) -> dict[str, int]:
    """Messages of one attention call by kind, as implemented (counted by ``CommLayer.calls`` on 4 ranks in every
    mode): team all-gathers and reduce-scatters (C > 1), the skewed k/v sends and the home sends (point-to-point),
    ring hops (G - 1 forward, 2 (G - 1) backward), Ulysses all-to-alls (2 each way)."""
    out = {"collective": 0, "p2p": 0}
    if cand.ulysses_degree > 1:
        out["collective"] += 2  # q/k/v in (one packed exchange), the output (or its gradients) back
    if cand.ring_size > 1:
        g, c = cand.group_size, cand.ring_count
        if c > 1:
            out["collective"] += (1 + 1) if backward else (2 + 1)  # all-gathers + reduce-scatter
            out["p2p"] += 2 if backward else 1  # skew (+ home)
        # ring hops: k/v forward; k/v and the dk/dv accumulators backward (+ the dk/dv sent home with C = 1)
        out["p2p"] += (2 * (g - 1) + (1 if c == 1 else 0)) if backward else g - 1
    return out


def _kernel_times(model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload) -> _KernelTimes:
    """Pure compute of one layer's pieces: the calibration's measured rates at each call's size, or peak x MFU."""
    b, n, s = workload.batch, workload.seq_len, workload.seq_len // cand.sp_size
    cal = cluster.calibration
    linear_f = b * model.layer_matmul_flops(s)
    mlp_f = 2.0 * b * s * model.mlp_matrices * model.hidden * model.intermediate
    # causal: half of QK^T (d) and PV (dv), 2 FLOPs per multiply-add
    attn_f = b * model.heads * (model.head_dim + model.value_head_dim) * n * n / cand.sp_size
    head_f = 6.0 * b * s * model.hidden * model.vocab
    if cal is None:
        flops = cluster.flops * cluster.mfu
        return _KernelTimes(linear=linear_f / flops, mlp=mlp_f / flops, attention=attn_f / flops,
                            attention_bwd=_BWD_ATTN * attn_f / flops, head=head_f / flops)
    tok_mlp = min(s, cand.mlp_chunk_tokens) if cand.mini_sequence and cand.mlp_chunk_tokens else s
    tok_head = min(s, cand.lm_head_chunk_tokens) if cand.mini_sequence and cand.lm_head_chunk_tokens else s
    mlp_call = 2.0 * b * tok_mlp * model.hidden * model.intermediate
    proj_f = linear_f - mlp_f
    proj_call = proj_f / 4
    # zigzag: of the rank's work 1/R is against its own k/v, half of that under the causal mask (its two diagonal
    # chunks); the other calls are full blocks
    calls = kernel_calls(cand)
    causal = 1.0 if cand.ring_size == 1 else 0.5 / cand.ring_size
    diag = attn_f * causal
    per_s = diag / cal.attention_rate(diag * (1 + _BWD_ATTN))
    if calls > 1:
        full = (attn_f - diag) / (calls - 1)
        per_s += (attn_f - diag) / cal.attention_rate(full * (1 + _BWD_ATTN), causal=False)
    mlp = mlp_f / cal.gemm_rate(mlp_call)
    return _KernelTimes(
        linear=proj_f / cal.gemm_rate(proj_call) + mlp, mlp=mlp, attention=per_s,
        attention_bwd=_BWD_ATTN * per_s,
        head=head_f / cal.gemm_rate(2.0 * b * tok_head * model.hidden * model.vocab),
    )


def _attention_time(
    kinds: dict[str, int], *, skew_fwd: int, attn: float, links: Links, cand: Candidate, workload: Workload,
    backward: bool,
) -> tuple[float, float, float]:
    """(wall time of one attention call, its communication before overlap, the exposed part of it), from its
    bytes by kind.

    Ulysses' all-to-alls are exposed (attention needs their result). Ring hops and WallFacer's team exchanges
    overlap the block kernels (pipelined: each piece is computed on as the next arrives); what stays exposed is
    the first remote k/v piece of each phase (a team member's share of the exchange, nothing to compute on yet
    but the own block), the backward's final dk/dv send home, and whatever the kernels cannot cover:
    exposed = unhideable + max(0, comm - unhideable - overlappable compute)."""
    c, g = cand.ring_count, cand.group_size
    a2a = _t(kinds.get("all_to_all", 0), links.a2a, 4)
    if cand.ring_size == 1:
        return a2a + attn, a2a, a2a
    coll = _t(kinds["all_gather"], links.team, (1 if backward else 2) * (c - 1))
    coll += _t(kinds["reduce_scatter"], links.team, c - 1)
    skew = _t(skew_fwd, links.skew, 1)
    home = _t(kinds["skew"] - skew_fwd, links.home, 1) if backward else 0.0
    hop = _t(kinds["ring"] / (g - 1), links.ring, 1) if g > 1 else 0.0
    ring_comm = coll + skew + home + (g - 1) * hop
    if not workload.overlap:
        return a2a + ring_comm + attn, a2a + ring_comm, a2a + ring_comm
    # the first remote piece: one member's share of the team exchange (C > 1); with plain ring the own block
    # runs first, so a hop always has a block to hide behind
    first = (coll + skew) / c if c > 1 else 0.0
    hidden_by = attn * (g - 1) / g if c == 1 else attn  # the last ring step's compute has nothing left to hide
    unhideable = first + home
    exposed = unhideable + max(0.0, ring_comm - unhideable - hidden_by)
    return a2a + attn + exposed, a2a + ring_comm, a2a + exposed


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


def oversubscription(cluster: ClusterSpec) -> float:
    """Ranks x threads of one node per core the calibration found (1 when they fit, or without a calibration)."""
    cal = cluster.calibration
    if cal is None:
        return 1.0
    return max(1.0, cluster.ranks_per_node * max(1, cal.threads) / max(1, cal.cores))


def _latency(cluster: ClusterSpec, kind: str) -> float:
    """Seconds per collective call of ``kind`` ("collective" or "p2p") outside the byte terms: the calibration's
    measured latency at this node's oversubscription (gloo on shared cores), else the preset's link latency."""
    cal = cluster.calibration
    if cal is not None and getattr(cal, "collective_s", None):
        return cal.latency(kind, oversubscription(cluster))
    return cluster.intra_latency if cluster.nodes == 1 else cluster.inter_latency


def _elementwise_bytes(model: ModelSpec, cand: Candidate, workload: Workload) -> float:
    """Bytes the memory-bound ops of one step move on a rank (read + written), roughly: per layer forward, two
    norms (6 passes each over T x H) and two residual adds (3 each), rotary on q and k (8 passes), attention's
    layout copies of q, k, v and the output (4 passes) and the log-sum-exp merge of each block call's output
    (6 passes over it), the gated activation (4 passes over T x I); the backward twice the forward, the
    recomputed forward once more under checkpointing (its MLP part under MsT)."""
    m, e = model, workload.elem_bytes
    t = workload.batch * workload.seq_len // cand.sp_size
    qd, kd = m.heads * m.head_dim, m.kv_heads * m.head_dim
    calls = kernel_calls(cand) if cand.sp_size > 1 else 1
    attn = t * (8 * (qd + kd) + 4 * (qd + 2 * kd) + 6 * qd * (calls - 1) / max(1, cand.ulysses_degree))
    mlp = t * 4 * m.intermediate
    fwd = e * (t * 18 * m.hidden + attn + mlp)
    again = (fwd if cand.checkpointing else 0.0) + (e * mlp if cand.mini_sequence and not cand.checkpointing else 0.0)
    return m.layers * (3 * fwd + again)


def _param_tensors(model: ModelSpec) -> int:
    """Parameter tensors: per layer four projections, the MLP's matrices and two norms; embedding, final norm and
    (untied) LM head."""
    return model.layers * (4 + model.mlp_matrices + 2) + 2 + (0 if model.tied_embeddings else 1)


def _per_call_terms(model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload, *,
                    re_attn: bool) -> tuple[float, float, float, float]:
    """(op calls, their overhead seconds, the optimizer's seconds, collective latency seconds) of one step, from the
    cluster's calibration: op calls x a tiny call's time plus elementwise bytes / memory bandwidth, the optimizer
    over this rank's parameter shard, and the per-collective latencies (``re_attn``: attention recomputed)."""
    cal = cluster.calibration
    layers = model.layers
    s = workload.seq_len // cand.sp_size
    mlp_chunks = _chunks(s, cand.mlp_chunk_tokens) if cand.mini_sequence else 1
    head_chunks = _chunks(s, cand.lm_head_chunk_tokens) if cand.mini_sequence else 1
    kc = kernel_calls(cand) if cand.sp_size > 1 else 1
    cf, cb = collective_calls(cand, backward=False), collective_calls(cand, backward=True)
    fwd_ops = (_OPS_LAYER + _OPS_ATTN_CALL + _OPS_BLOCK * kc + _OPS_MLP_CHUNK * mlp_chunks
               + _OPS_COLLECTIVE * sum(cf.values()))
    re_ops = 0.0
    if cand.checkpointing:
        re_ops = _OPS_LAYER + _OPS_MLP_CHUNK * mlp_chunks
        if re_attn:
            re_ops += _OPS_ATTN_CALL + _OPS_BLOCK * kc + _OPS_COLLECTIVE * sum(cf.values())
    elif cand.mini_sequence:
        re_ops = _OPS_MLP_CHUNK * mlp_chunks
    bwd_ops = _BWD_OPS * (_OPS_LAYER + _OPS_ATTN_CALL + _OPS_BLOCK * kc + _OPS_MLP_CHUNK * mlp_chunks) + \
        _OPS_COLLECTIVE * sum(cb.values())
    ops = layers * (fwd_ops + re_ops + bwd_ops) + (1 + _BWD_OPS) * _OPS_HEAD_CHUNK * head_chunks + _OPS_STEP + \
        _OPS_PARAM * _param_tensors(model)
    overhead = ops * cal.op_s + _elementwise_bytes(model, cand, workload) / cal.mem_bw
    w = cluster.world_size
    shard = model.params / (w if workload.zero_stage >= 1 else 1)
    optimizer = shard * cal.adam_s_per_param
    per_layer_lat = (cf["collective"] + cb["collective"] + (cf["collective"] if re_attn else 0)) * \
        _latency(cluster, "collective") + (cf["p2p"] + cb["p2p"] + (cf["p2p"] if re_attn else 0)) * \
        _latency(cluster, "p2p")
    step_coll = (_LOSS_COLLECTIVES if cand.sp_size > 1 else 0) + (_STEP_COLLECTIVES if w > 1 else 0)
    latency = layers * per_layer_lat + step_coll * _latency(cluster, "collective")
    return ops, overhead, optimizer, latency


def estimate(
    model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload, *, links: Links | None = None
) -> CostBreakdown:
    """Predict one training step of ``cand`` on ``cluster`` (``links``: a cached ``analyse_links`` result).

    Step = (compute + op overhead + optimizer) x oversubscription + exposed communication; with a calibration
    (``ClusterSpec.calibration``) compute uses the measured rates, and the op overhead, the optimizer step and the
    per-collective latencies are counted; without one, peak FLOP/s x MFU and the link figures alone."""
    links = links or analyse_links(cand, cluster)
    cal = cluster.calibration
    t = _kernel_times(model, cluster, cand, workload)
    by = layer_bytes(model, cand, workload)
    fb, bb = by["forward"], by["backward"]
    common = dict(skew_fwd=fb.get("skew", 0), links=links, cand=cand, workload=workload)
    fwd_attn, fwd_comm, fwd_exp = _attention_time(fb, attn=t.attention, backward=False, **common)
    bwd_attn, bwd_comm, bwd_exp = _attention_time(bb, attn=t.attention_bwd, backward=True, **common)

    # what backward runs again: the layer forward under checkpointing (attention too, unless its output is kept),
    # and the MLP under MsT
    re_attn = cand.checkpointing and not cand.keep_attention
    re_comm, re_exp, re_bytes, re_compute = 0.0, 0.0, 0, 0.0
    if cand.checkpointing:
        re_compute = t.linear + (t.attention if re_attn else 0.0)
        if re_attn:
            re_comm, re_exp, re_bytes = fwd_comm, fwd_exp, sum(fb.values())
    if cand.mini_sequence:
        re_compute += t.mlp

    layers = model.layers
    compute = layers * (3 * t.linear + t.attention + t.attention_bwd + re_compute) + t.head
    comm = layers * (fwd_comm + bwd_comm + re_comm)
    attn_exposed = layers * (fwd_exp + bwd_exp + re_exp)
    zero_bytes, zero_s = _zero_traffic(model, cluster, workload)
    bwd_total = layers * (2 * t.linear + t.attention_bwd)
    exposed_zero = max(0.0, zero_s - bwd_total) if workload.overlap else zero_s

    # per-call terms (a calibration only): op calls x a tiny call's time, collective latencies, the optimizer
    over = oversubscription(cluster)
    ops, overhead, optimizer, latency = (_per_call_terms(model, cluster, cand, workload, re_attn=re_attn)
                                         if cal is not None else (0.0, 0.0, 0.0, 0.0))

    busy = compute + overhead + optimizer
    exposed = attn_exposed + exposed_zero + latency
    step = over * busy + exposed
    return CostBreakdown(
        fwd_bytes=dict(fb), bwd_bytes=dict(bb),
        step_bytes=layers * (sum(fb.values()) + sum(bb.values()) + re_bytes),
        zero_bytes=zero_bytes, compute_s=compute, comm_s=comm, zero_s=zero_s, step_s=step,
        tokens_per_s=(cluster.world_size // cand.sp_size) * workload.batch * workload.seq_len / step,
        attn_layer_s=fwd_attn + bwd_attn, links=links, exposed_comm_s=exposed, overhead_s=overhead,
        optimizer_s=optimizer, ops=ops, oversubscription=over,
        detail={"compute_s": compute, "overhead_s": overhead, "optimizer_s": optimizer,
                "oversubscription": over, "attention_exposed_s": attn_exposed, "zero_exposed_s": exposed_zero,
                "latency_s": latency},
    )


def forward_s(model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload, *,
              links: Links | None = None) -> float:
    """Predicted seconds of one forward pass without gradients (``workload.batch`` sequences per SP group): every
    layer's projections, MLP and attention with its exposed communication, and the LM head's forward (a third of
    its forward + backward). What scoring a rollout costs (``planner/rl.py``: the old policy's and the
    reference's log-probabilities)."""
    links = links or analyse_links(cand, cluster)
    t = _kernel_times(model, cluster, cand, workload)
    fb = layer_bytes(model, cand, workload)["forward"]
    _, _, exposed = _attention_time(fb, attn=t.attention, backward=False, skew_fwd=fb.get("skew", 0), links=links,
                                    cand=cand, workload=workload)
    busy = model.layers * (t.linear + t.attention) + t.head / 3
    return oversubscription(cluster) * busy + model.layers * exposed


def paper_figures(shape: AttnShape, *, sp_size: int, ring_count: int) -> dict[str, float]:
    """The paper's forward bytes per rank per layer (docs/design/attention.md), three ways:

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
