"""Exact bytes each rank sends per attention call, as implemented, and the paper's formulas beside them.

Pure arithmetic: the planner's cost model uses these, and the tests assert them against the bytes the
comm layer counted. Symbols as in ``wallfacer.py``: n_q = B*hq*S_l*d and n_kv = B*hk*S_l*d elements per
rank, S_l = N / P, s = input element size, a = element size of the summed partials/gradients (fp32 = 4).

Differences from the paper's formulas (docs/design.md §2), all deliberate:
- k/v are not all-gathered in the team: a skewed gather sends each rank's k/v shard straight to the C lanes
  that start with its team (C*2*n_kv*s; (C-1)*2*n_kv*s for local 0), so the paper's two k/v all-gathers
  are replaced by this one step; the paper's ring term starts counting after it
- the forward reduce-scatter carries fp32 partial outputs (a = 4) plus an all-gather of the fp32 partial
  lse (C*B*hq*S_l*4 per rank), so bf16 outputs are merged without rounding the partials
- k/v rotate in backward (their gradients travel behind them in fp32, and each rank's slice goes home in
  one final send that also undoes the skew, replacing the team reduce-scatter of dk/dv); q, out and dO are
  re-gathered in the team and k/v re-fetched by the skewed gather instead of being kept
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AttnShape", "wallfacer_bytes", "ulysses_bytes", "paper_ring_bytes", "paper_wallfacer_bytes"]


@dataclass(frozen=True)
class AttnShape:
    """One attention call: the full sequence and the head layout."""

    batch: int
    seq_len: int
    """N: full sequence length (all ranks together)."""
    q_heads: int
    kv_heads: int
    head_dim: int
    elem_bytes: int = 2
    """Element size of q, k, v (bf16 = 2)."""
    accum_bytes: int = 4
    """Element size of summed partial outputs and gradients on the wire (fp32 = 4)."""

    def per_rank(self, sp_size: int) -> tuple[int, int, int]:
        """(n_q, n_kv, n_lse): elements of q, of k (or v) and of q's lse on one rank."""
        s_l = self.seq_len // sp_size
        return (self.batch * self.q_heads * s_l * self.head_dim, self.batch * self.kv_heads * s_l * self.head_dim,
                self.batch * self.q_heads * s_l)


def wallfacer_bytes(
    shape: AttnShape, *, sp_size: int, ring_count: int, local: int, ring_steps: int | None = None
) -> dict[str, dict[str, int]]:
    """Bytes sent by a rank with team position ``local``, per phase and kind, for one attention call.
    ``ring_steps``: the steps a sliding window leaves (``wallfacer.ring_steps``; None: all G)."""
    p, c = sp_size, ring_count
    g = p // (c * c) if ring_steps is None else ring_steps
    s, a = shape.elem_bytes, shape.accum_bytes
    n_q, n_kv, n_l = shape.per_rank(p)
    kv_dests = c - (1 if local == 0 else 0)  # the skewed gather sends the own k/v shard to each lane
    home_dests = c - (1 if local == 0 and g == 1 else 0)  # dk/dv slices returned to the block's team
    fwd = {
        "all_gather": (c - 1) * (n_q * s + c * n_l * 4),
        "reduce_scatter": (c - 1) * n_q * a,
        "skew": kv_dests * 2 * n_kv * s,
        "ring": (g - 1) * 2 * c * n_kv * s,
    }
    bwd = {
        "all_gather": (c - 1) * 3 * n_q * s,
        "reduce_scatter": (c - 1) * n_q * a,
        "skew": kv_dests * 2 * n_kv * s + home_dests * 2 * n_kv * a,
        "ring": (g - 1) * 2 * c * n_kv * (s + a),
    }
    return {"forward": fwd, "backward": bwd}


def ulysses_bytes(shape: AttnShape, *, degree: int, sp_size: int | None = None) -> dict[str, dict[str, int]]:
    """DeepSpeed-Ulysses all-to-all of degree U over shards of N / sp_size tokens (sp_size = U alone, or
    U * rings in the hybrid): q, k, v in and the output back, each sending (U-1)/U of its shard; backward
    mirrors it (dO in; dq, dk, dv back). When U exceeds the kv heads (U a multiple of hk), each kv head is
    replicated U / hk times before the all-to-all (``ulysses.py``), so k and v travel with U heads."""
    u = degree
    n_q, n_kv, _ = shape.per_rank(sp_size or u)
    if shape.kv_heads % u:
        n_kv = n_kv // shape.kv_heads * u
    s = shape.elem_bytes
    fwd = (u - 1) * ((2 * n_q + 2 * n_kv) * s) // u
    return {"forward": {"all_to_all": fwd}, "backward": {"all_to_all": fwd}}


def paper_ring_bytes(shape: AttnShape, *, sp_size: int) -> int:
    """Paper: ring attention forward, (P-1) * 2BNH/P bytes per rank (k and v each hop)."""
    n_q, n_kv, _ = shape.per_rank(sp_size)
    return (sp_size - 1) * 2 * n_kv * shape.elem_bytes


def paper_wallfacer_bytes(shape: AttnShape, *, sp_size: int, ring_count: int) -> dict[str, int]:
    """Paper: WallFacer forward, collectives 4BNH(C-1)/P and ring (P/C^2 - 1) * 2CBNH/P bytes per rank."""
    p, c = sp_size, ring_count
    n_q, n_kv, _ = shape.per_rank(p)
    s = shape.elem_bytes
    return {"collective": 4 * (c - 1) * n_q * s, "ring": (p // (c * c) - 1) * 2 * c * n_kv * s}
