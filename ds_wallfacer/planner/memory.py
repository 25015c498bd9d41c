"""Memory model: peak bytes per rank of one training step (``memory_breakdown``): model states, checkpointed
activations, and the larger of one decoder layer's working set and the LM head's.

Design: Note [Memory model] in docs/design.md §10 (each term's formula).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..attention.volume import DEFAULT_SUM_DTYPES
from .candidate import Candidate, Workload
from .cluster import GIB, ClusterSpec
from .cost import kv_heads_on_wire
from .model import ModelSpec

__all__ = ["MemoryBreakdown", "memory_breakdown", "GIB"]

_FP32 = 4


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the step's peak."""

    weights: float
    grads: float
    optimizer: float
    checkpoints: float
    """Activations kept across the forward for the backward."""
    attention: float
    """Attention working set of one layer (includes ``team_copies``)."""
    team_copies: float
    """WallFacer's extra team copies of q, k, v: (C-1) x the local q, k, v."""
    layer: float
    """Rest of one layer's working set: 8 hidden-size activations and gradients, the MLP (one mini-sequence with MsT)."""
    lm_head: float
    """LM head + loss working set (one mini-sequence with MsT)."""
    usable: float
    """Device memory minus the framework's reserve and the fragmentation headroom."""

    @property
    def total(self) -> float:
        states = self.weights + self.grads + self.optimizer + self.checkpoints
        return states + max(self.attention + self.layer, self.lm_head)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    def largest(self) -> str:
        """Name of the biggest term (for rejection reasons)."""
        terms = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("usable", "team_copies")}
        return max(terms, key=terms.get)

    def describe(self) -> str:
        keys = ("weights", "grads", "optimizer", "checkpoints", "attention", "layer", "lm_head")
        return ", ".join(f"{k} {getattr(self, k) / GIB:.1f}" for k in keys) + f" GiB; usable {self.usable / GIB:.1f} GiB"


def memory_breakdown(model: ModelSpec, cluster: ClusterSpec, cand: Candidate, workload: Workload) -> MemoryBreakdown:
    """Peak memory per rank of ``cand`` (raises ``ValueError`` when its Ulysses degree does not fit the heads)."""
    w, s, psi = cluster.world_size, workload.elem_bytes, model.params
    b, n, p = workload.batch, workload.seq_len, cand.sp_size
    tokens = b * (n // p)  # local tokens of this rank
    h, d, i, v = model.hidden, model.head_dim, model.intermediate, model.vocab
    hq = model.heads
    hk = kv_heads_on_wire(model, cand.ulysses_degree, kv_replication=workload.kv_replication)
    if hk is None:
        raise ValueError(f"Ulysses degree {cand.ulysses_degree} does not fit {hq} heads / {model.kv_heads} kv heads")
    stage = workload.zero_stage
    weights = s * psi if stage < 3 else s * psi / w + 2 * s * max(model.layer_params, v * h)
    grads = s * psi if stage < 2 else s * psi / w
    optimizer = 0.0 if workload.offload_optimizer else 16.0 * psi / (w if stage >= 1 else 1)

    # attention working set, per rank: U q/kv heads groups of hq/U over N/R tokens = same element counts
    qkv = tokens * (hq + 2 * hk) * d  # elements of this rank's q, k, v (after any all-to-all: same count)
    kv, q = tokens * 2 * hk * d, tokens * hq * d
    c = cand.ring_count
    a2a = 3 * qkv * s if cand.ulysses_degree > 1 else 0.0  # in/out buffers of q, k, v (or dO, dq, dk, dv)
    if cand.ring_size == 1:
        attn = a2a + 2 * qkv * s + q * s + tokens * hq * _FP32
        team_copies = 0.0
    else:
        a_out, a_dq, a_ring, a_home = DEFAULT_SUM_DTYPES.nbytes(s)
        team_copies = (c - 1) * qkv * s
        fwd = c * qkv * s + 3 * c * kv * s + c * q * (_FP32 + a_out)  # fp32 accumulator, weighted partials
        expand = 4 * c * q * s + c * kv * _FP32 if hq > hk and s < _FP32 else 0  # expanded k/v, per-head dk/dv
        bwd = (c * (qkv + 2 * q) * s  # gathered q, k, v, out, dO
               + 2 * c * kv * s  # k/v block and the next one in flight
               + c * kv * (_FP32 + 2 * a_ring)  # dk/dv of the held block (fp32), the one in flight, the received one
               + c * q * _FP32  # dq accumulator
               + c * (q * a_dq + kv * a_home)  # dq reduce-scatter input, dk/dv slices sent home
               + expand)
        attn = a2a + max(fwd, bwd) + c * tokens * hq * _FP32 + qkv * s
    mlp_tokens = min(tokens, cand.mlp_chunk_tokens) if cand.mini_sequence else tokens
    layer = 8 * tokens * h * s + 7 * mlp_tokens * i * s
    head_tokens = min(tokens, cand.lm_head_chunk_tokens) if cand.mini_sequence else tokens
    lm_head = 3 * head_tokens * v * _FP32 + 2 * tokens * h * s

    if cand.checkpointing:
        kept = 2 if workload.offload_checkpoints else model.layers
        checkpoints = kept * tokens * h * s
    else:
        per_layer = tokens * ((4 * h + (2 * hq + 2 * hk) * d) * s + c * hq * _FP32)
        if not cand.mini_sequence:
            per_layer += 3 * tokens * i * s
        else:
            per_layer += tokens * h * s
        checkpoints = model.layers * per_layer
    usable = cluster.mem_bytes * (1 - workload.mem_headroom) - cluster.mem_reserved
    return MemoryBreakdown(
        weights=weights, grads=grads, optimizer=optimizer, checkpoints=checkpoints, attention=attn,
        team_copies=team_copies, layer=layer, lm_head=lm_head, usable=usable,
    )
