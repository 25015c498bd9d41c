"""Memory model: peak bytes per rank of one training step (``memory_breakdown``): model states (with ZeRO and each
offload), checkpointed layer inputs, kept attention results, and the larger of one decoder layer's backward working
set and the LM head's; and the host bytes the offloads use.

Design: Note [Memory model] in docs/design/planner.md (each term's formula).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..attention.volume import DEFAULT_SUM_DTYPES, kept_bytes_per_layer
from .candidate import Candidate, Workload
from .cluster import GIB, ClusterSpec
from .cost import kv_heads_on_wire
from .model import ModelSpec

__all__ = ["GIB", "REDUCE_BUCKET_ELEMS", "MemoryBreakdown", "memory_breakdown"]

_FP32 = 4


REDUCE_BUCKET_ELEMS = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size``: the gradients a rank holds on the device when the
optimizer (and with it the gradient partition) is offloaded."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the step's peak (on the device, unless named ``host``)."""

    weights: float
    grads: float
    optimizer: float
    checkpoints: float
    """Checkpointed layer inputs on the device (every layer's, or with offload the one recomputed and the one
    coming back), and the rotary tables; without checkpointing every layer's saved activations."""
    kept: float
    """Attention results kept from the first forward for the backward (``keep_attention``), every layer."""
    attention: float
    """Attention's working set in the backward beyond the layer's own tensors (gradients of q, k, v and of the
    output; the parallel modes' buffers, including ``team_copies``)."""
    team_copies: float
    """WallFacer's extra team copies of q, k, v: (C-1) x the local q, k, v."""
    layer: float
    """The rest of the working set at the peak of one layer's backward: the gradient arriving at the layer, the
    tensors its recompute holds, and (when larger) the MLP backward with one mini-sequence's intermediates."""
    lm_head: float
    """LM head + loss working set: the last hidden states, their gradient, one mini-sequence's logits, the fp32
    weight-gradient accumulator."""
    host: float
    """Bytes per rank in host memory: offloaded optimizer state, parameters and checkpoints."""
    usable: float
    """Device memory minus the framework's reserve and the fragmentation headroom."""
    host_usable: float = float("inf")
    """Host memory per rank (inf: not checked)."""

    @property
    def activations(self) -> float:
        """The peak of what one step creates: checkpoints, kept results and the larger working set."""
        return self.checkpoints + self.kept + max(self.attention + self.layer, self.lm_head)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.usable and self.host <= self.host_usable

    def largest(self) -> str:
        """Name of the biggest term (for rejection reasons)."""
        skip = ("usable", "host_usable", "team_copies", "host")
        terms = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        return max(terms, key=terms.get)

    def describe(self) -> str:
        keys = ("weights", "grads", "optimizer", "checkpoints", "kept", "attention", "layer", "lm_head")
        host = f"; host {self.host / GIB:.1f} GiB" if self.host else ""
        return (", ".join(f"{k} {getattr(self, k) / GIB:.1f}" for k in keys)
                + f" GiB; usable {self.usable / GIB:.1f} GiB{host}")


def _model_states(model: ModelSpec, cluster: ClusterSpec, workload: Workload) -> tuple[float, float, float, float]:
    """(weights, gradients, optimizer state on the device, bytes on the host) per rank."""
    w, s, psi = cluster.world_size, workload.elem_bytes, model.params
    stage, h, v = workload.zero_stage, model.hidden, model.vocab
    gathered = 2 * s * max(model.layer_params, v * h)  # ZeRO-3: the module gathered and the one prefetched
    host = 0.0
    if stage < 3:
        weights = s * psi
    elif workload.offload_params:
        weights, host = gathered, s * psi / w
    else:
        weights = s * psi / w + gathered
    grads = s * psi if stage < 2 else s * psi / w
    optimizer = 16.0 * psi / (w if stage >= 1 else 1)  # fp32 master, Adam m and v, fp32 gradient partition
    if workload.offload_optimizer:
        host += optimizer
        optimizer = 0.0
        if stage >= 2:  # the gradient partition lives on the host; the device holds a reduce bucket
            grads = min(grads, s * REDUCE_BUCKET_ELEMS)
    return weights, grads, optimizer, host


def memory_breakdown(model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload) -> MemoryBreakdown:
    """Peak memory per rank of ``cand`` (raises ``ValueError`` when its Ulysses degree does not fit the heads).

    The terms are the tensors the runtime holds at the peak of a step, named in Note [Memory model] in
    docs/design/planner.md; ``tests/planner/test_memory_measured.py`` checks them against a measured step."""
    s = workload.elem_bytes
    b, n, p = workload.batch, workload.seq_len, cand.sp_size
    tokens = b * (n // p)  # local tokens of this rank
    h, d, dv, i, v = model.hidden, model.head_dim, model.value_head_dim, model.intermediate, model.vocab
    hq = model.heads
    hk = kv_heads_on_wire(model, cand.ulysses_degree, kv_replication=workload.kv_replication)
    if hk is None:
        raise ValueError(f"Ulysses degree {cand.ulysses_degree} does not fit {hq} heads / {model.kv_heads} kv heads")
    weights, grads, optimizer, host = _model_states(model, cluster, workload)

    x = tokens * h * s  # one layer input
    q, k, vv, o = (tokens * hq * d * s, tokens * hk * d * s, tokens * hk * dv * s, tokens * hq * dv * s)
    lse = tokens * hq * _FP32
    c = cand.ring_count
    keep = cand.checkpointing and cand.keep_attention
    kept_layer = kept_bytes_per_layer(
        batch=b, local_tokens=n // p, q_heads=hq, kv_heads=model.kv_heads, head_dim=d, value_dim=dv, elem_bytes=s,
        ulysses_degree=cand.ulysses_degree, ring_size=cand.ring_size, ring_count=c)
    kept = model.layers * kept_layer if keep else 0.0
    rotary = 2 * tokens * d * s  # cos and sin

    # attention's own backward working set: dq, dk, dv (P = 1, or Ulysses alone: its all-to-all buffers too; dO is
    # passed to the kernel in the layout it arrives in); the parallel modes' formula otherwise
    team_copies = 0.0
    qkv = q + k + vv
    a2a = 3 * qkv if cand.ulysses_degree > 1 else 0.0  # in/out buffers of q, k, v (or dO, dq, dk, dv)
    if cand.ring_size == 1:
        attention = a2a + qkv
    else:
        a_out, a_dq, a_ring, a_home = DEFAULT_SUM_DTYPES.nbytes(s)
        e_q, e_kv = q / s, (k + vv) / s  # elements
        team_copies = (c - 1) * qkv
        fwd = c * qkv + 3 * c * (k + vv) + c * e_q * (_FP32 + a_out)  # fp32 accumulator, weighted partials
        expand = 4 * c * q + c * e_kv * _FP32 if hq > hk and s < _FP32 else 0  # expanded k/v, per-head dk/dv
        bwd = (c * (qkv + 2 * o)  # gathered q, k, v, out, dO
               + 2 * c * (k + vv)  # k/v block and the next one in flight
               + c * e_kv * (_FP32 + 2 * a_ring)  # dk/dv of the held block (fp32), the one in flight, received
               + c * e_q * _FP32  # dq accumulator
               + c * (e_q * a_dq + e_kv * a_home)  # dq reduce-scatter input, dk/dv slices sent home
               + expand)
        attention = a2a + max(fwd, bwd) + c * lse + o
    if not keep:
        attention += o + lse  # the recompute's (or, without checkpointing, the backward's) output and lse

    mlp_tokens = min(tokens, cand.mlp_chunk_tokens) if cand.mini_sequence else tokens
    mlp_chunk = (model.mlp_matrices * 2) * mlp_tokens * i * s + mlp_tokens * h * s  # intermediates, their grads
    if cand.checkpointing:
        # offloaded (mini_sequence.offload_checkpoints, or DeepSpeed's cpu_checkpointing): only the input of the
        # layer being recomputed comes back
        checkpoints = (1 if workload.offload_checkpoints else model.layers) * x + rotary
        if workload.offload_checkpoints:
            host += model.layers * x
        # the arriving gradient, the layer's normalised input, q, k, v (rotated), the recomputed output (reentrant
        # checkpointing holds it), the residual branch's gradient and the output projection's input gradient
        held = x if cand.reentrant else 0.0
        layer_attn = 3 * x + held + qkv + o
        # during the MLP's backward: also the attention half's sum and its normalised copy, the input gradient
        layer_mlp = 5 * x + held + qkv + (0 if keep else o + lse) + mlp_chunk
        layer = max(layer_attn, layer_mlp - attention)
    else:
        per_layer = 4 * x + qkv + o + lse  # input, normalised input, q, k, v, out, lse, mid sum, its norm
        if not cand.mini_sequence:
            per_layer += (model.mlp_matrices + 1) * tokens * i * s  # gate, up, activation, product
        checkpoints = model.layers * per_layer + rotary
        layer = 2 * x + o  # the arriving gradient, the residual branch's, the output projection's input's
        attention -= o + lse  # saved with the layer already
    head_tokens = min(tokens, cand.lm_head_chunk_tokens) if cand.mini_sequence else tokens
    # fp32 logits (their own gradient in place) and, for 16-bit weights, their cast; the fp32 weight-gradient sum
    lm_head = 3 * x + head_tokens * v * (_FP32 + (s if s < _FP32 else 0)) + v * h * _FP32
    usable = cluster.mem_bytes * (1 - workload.mem_headroom) - cluster.mem_reserved
    return MemoryBreakdown(
        weights=weights, grads=grads, optimizer=optimizer, checkpoints=checkpoints, kept=kept, attention=attention,
        team_copies=team_copies, layer=layer, lm_head=lm_head, host=host, usable=usable,
        host_usable=cluster.host_mem_bytes / cluster.ranks_per_node if cluster.host_mem_bytes else float("inf"),
    )
