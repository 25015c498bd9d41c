"""Exact bytes each rank sends per attention call, as implemented (``wallfacer_bytes``, ``ulysses_bytes``), and the
paper's formulas beside them (``paper_ring_bytes``, ``paper_wallfacer_bytes``).

Pure arithmetic: the planner's cost model uses these, and the tests assert them against the bytes the comm layer
counted. ``SumDtypes`` says in which dtype each tensor summed across ranks travels (defaults: ``DEFAULT_SUM_DTYPES``,
wallfacer.py Note [Summed tensors on the wire]).

Design: Note [Bytes as implemented] in docs/design/attention.md (the formulas, and why they differ from the paper's).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AttnShape", "DEFAULT_SUM_DTYPES", "SumDtypes", "wallfacer_bytes", "ulysses_bytes", "paper_ring_bytes",
    "paper_wallfacer_bytes", "kept_bytes_per_layer", "needed_positions", "fetch_bytes",
]

_DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


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
    value_dim: int | None = None
    """Head dim of v and of the output (None: ``head_dim``; multi-head latent attention's is smaller)."""

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    def per_rank(self, sp_size: int) -> tuple[int, int, int]:
        """(n_q, n_kv, n_lse): elements of q, of k and v together, and of q's lse on one rank."""
        s_l = self.seq_len // sp_size
        return (self.batch * self.q_heads * s_l * self.head_dim,
                self.batch * self.kv_heads * s_l * (self.head_dim + self.v_dim), self.batch * self.q_heads * s_l)

    def per_rank_out(self, sp_size: int) -> int:
        """n_o: elements of the output (and of dO) on one rank."""
        return self.batch * self.q_heads * (self.seq_len // sp_size) * self.v_dim


@dataclass(frozen=True)
class SumDtypes:
    """The dtype each tensor that WallFacer sums across ranks travels in: "input" (q's dtype) or a dtype name
    ("float32", "bfloat16", "float16"). Sums on a rank are always fp32; these are what a partial sum is rounded
    to before it is sent (``WallFacerAttention.accum_comm_dtype``)."""

    out: str = "input"
    """lse-weighted partial outputs, forward team reduce-scatter."""
    dq: str = "input"
    """dq partials, backward team reduce-scatter."""
    dkv_ring: str = "float32"
    """dk/dv accumulators passed along the sub-ring: a running sum rounded again at every hop."""
    dkv_home: str = "input"
    """Each lane's final dk/dv slice sent to the shard's owner (summed there in fp32, rounded once)."""

    def __post_init__(self) -> None:
        for name in ("out", "dq", "dkv_ring", "dkv_home"):
            value = getattr(self, name)
            if value != "input" and value not in _DTYPE_BYTES:
                raise ValueError(f"SumDtypes.{name}={value!r}: expected 'input' or one of {sorted(_DTYPE_BYTES)}")

    @classmethod
    def uniform(cls, name: str) -> "SumDtypes":
        """Every summed tensor in ``name`` ("input" or a dtype name)."""
        return cls(name, name, name, name)

    def nbytes(self, elem_bytes: int) -> tuple[int, int, int, int]:
        """(a_out, a_dq, a_ring, a_home): element sizes on the wire for inputs of ``elem_bytes``."""
        size = lambda n: elem_bytes if n == "input" else _DTYPE_BYTES[n]  # noqa: E731
        return size(self.out), size(self.dq), size(self.dkv_ring), size(self.dkv_home)


DEFAULT_SUM_DTYPES = SumDtypes()
"""What ``WallFacerAttention`` sends by default (measured: wallfacer.py Note [Summed tensors on the wire])."""


def wallfacer_bytes(
    shape: AttnShape, *, sp_size: int, ring_count: int, local: int, ring_steps: int | None = None,
    sums: SumDtypes = DEFAULT_SUM_DTYPES, q_kept: bool = False, gather_out: bool = True,
) -> dict[str, dict[str, int]]:
    """Bytes sent by a rank with team position ``local``, per phase and kind, for one attention call.
    ``ring_steps``: the steps a sliding window leaves (``schedule.ring_steps``; None: all G); ``sums``: the
    dtypes of the summed tensors (``WallFacerAttention.sum_dtypes``); ``q_kept``: the team's q kept from the
    forward (``WallFacerAttention.keep_team_q``); ``gather_out``: backward gathers out (False: the fp32 delta,
    for a kernel with ``backward_delta``)."""
    p, c = sp_size, ring_count
    g = p // (c * c) if ring_steps is None else ring_steps
    s = shape.elem_bytes
    a_out, a_dq, a_ring, a_home = sums.nbytes(s)
    n_q, n_kv, n_l = shape.per_rank(p)
    n_o = shape.per_rank_out(p)
    kv_dests = c - (1 if local == 0 else 0)  # the skewed gather sends the own k/v shard to each lane
    home_dests = c - (1 if local == 0 and g == 1 else 0)  # dk/dv slices returned to the block's team
    fwd = {  # the team's q; each other member's rows: its partial output and their fp32 lse
        "all_gather": (c - 1) * n_q * s,
        "reduce_scatter": (c - 1) * (n_o * a_out + n_l * 4),
        "skew": kv_dests * n_kv * s,
        "ring": (g - 1) * c * n_kv * s,
    }
    gathered = (0 if q_kept else n_q * s) + n_o * s + (n_o * s if gather_out else n_l * 4) + n_l * 4  # + lse
    bwd = {
        "all_gather": (c - 1) * gathered,
        "reduce_scatter": (c - 1) * n_q * a_dq,
        "skew": kv_dests * n_kv * s + home_dests * n_kv * a_home,
        "ring": (g - 1) * c * n_kv * (s + a_ring),
    }
    return {"forward": fwd, "backward": bwd}


def needed_positions(
    starts: tuple[tuple[int, ...], ...] | None, *, shards: tuple[tuple[int, ...], ...], chunk_len: int,
    causal: bool = True, window: int | None = None, spans: tuple[tuple[tuple[int, int], ...], ...] | None = None,
) -> list[list[int]]:
    """needed[i][j]: key positions of rank j's shard that some query of rank i sees (i != j; 0 on the diagonal),
    some row of the batch at least: what a rank must receive from another and no more (the direct fetch,
    ``fetch.py``). ``starts``: per batch row the documents' global starts (None: one document); ``shards``: the chunks
    each rank holds; ``spans``: per row its bidirectional spans (``documents.BatchDocuments.spans``). Counted token
    by token, independently of the kernel-call schedule: a key t is seen from rank i iff the first position u >= t
    that i holds is in t's document and (with a window) u - t < window, or t lies in a span of which i holds a
    position before t (non-causal: iff i holds any position of t's document)."""
    import torch

    p = len(shards)
    owner_of_chunk = torch.empty(sum(len(c) for c in shards), dtype=torch.long)
    for i, chunks in enumerate(shards):
        owner_of_chunk[list(chunks)] = i
    n = owner_of_chunk.numel() * chunk_len
    pos = torch.arange(n)
    owner = owner_of_chunk[pos // chunk_len]
    held = [pos[owner == i] for i in range(p)]
    seen = torch.zeros(p, n, dtype=torch.bool)
    rows = starts or ((0,),) * (len(spans) if spans else 1)
    for row, row_spans in sorted(set(zip(rows, spans or ((),) * len(rows)))):
        doc = torch.searchsorted(torch.tensor(row), pos, right=True) - 1
        span = torch.full((n,), -1, dtype=torch.long)  # each position's span, -1 outside
        for s, (a, b) in enumerate(row_spans):
            span[a:b] = s
        for i in range(p):
            if causal:
                at = torch.searchsorted(held[i], pos)
                has = at < held[i].numel()
                u = held[i][at.clamp(max=held[i].numel() - 1)]
                vis = has & (doc[u] == doc)
                if window is not None:
                    vis &= (u - pos) < window
                if row_spans:  # the first position rank i holds in each span: every later key of it is seen
                    first = torch.full((len(row_spans),), n, dtype=torch.long)
                    inside = span[held[i]] >= 0
                    first.scatter_reduce_(0, span[held[i]][inside], held[i][inside], "amin")
                    vis |= (span >= 0) & (first[span.clamp(min=0)] < pos)
            else:
                vis = torch.isin(doc, doc[held[i]].unique())
            seen[i] |= vis & (owner != i)
    return [torch.bincount(owner[seen[i]], minlength=p).tolist() for i in range(p)]


def fetch_bytes(
    shape: AttnShape, needed: list[list[int]], *, index: int, sums: SumDtypes = DEFAULT_SUM_DTYPES,
) -> dict[str, dict[str, int]]:
    """Bytes rank ``index`` sends under the direct fetch (Note [Direct fetch] in ``fetch.py``), from
    ``needed_positions``: forward, the k/v rows of its shard others need; backward, those again and the dk/dv of the
    rows it fetched, back to their owners (in ``sums.dkv_home``)."""
    s = shape.elem_bytes
    row = shape.batch * shape.kv_heads * (shape.head_dim + shape.v_dim)  # k and v of one position, all rows
    served = sum(needed[i][index] for i in range(len(needed)))
    fetched = sum(needed[index])
    a_home = sums.nbytes(s)[3]
    return {"forward": {"fetch": served * row * s},
            "backward": {"fetch": served * row * s, "fetch_grad": fetched * row * a_home}}


def ulysses_bytes(shape: AttnShape, *, degree: int, sp_size: int | None = None) -> dict[str, dict[str, int]]:
    """DeepSpeed-Ulysses all-to-all of degree U over shards of N / sp_size tokens (sp_size = U alone, or
    U * rings in the hybrid): q, k, v in and the output back, each sending (U-1)/U of its shard; backward
    mirrors it (dO in; dq, dk, dv back). When U exceeds the kv heads (U a multiple of hk), each kv head is
    replicated U / hk times before the all-to-all (``ulysses.py``), so k and v travel with U heads."""
    u = degree
    n_q, n_kv, _ = shape.per_rank(sp_size or u)
    n_o = shape.per_rank_out(sp_size or u)
    if shape.kv_heads % u:
        n_kv = n_kv // shape.kv_heads * u
    s = shape.elem_bytes
    fwd = (u - 1) * ((n_q + n_kv + n_o) * s) // u
    return {"forward": {"all_to_all": fwd}, "backward": {"all_to_all": fwd}}


def paper_ring_bytes(shape: AttnShape, *, sp_size: int) -> int:
    """Paper: ring attention forward, (P-1) * 2BNH/P bytes per rank (k and v each hop)."""
    n_q, n_kv, _ = shape.per_rank(sp_size)
    return (sp_size - 1) * n_kv * shape.elem_bytes


def paper_wallfacer_bytes(shape: AttnShape, *, sp_size: int, ring_count: int) -> dict[str, int]:
    """Paper: WallFacer forward, collectives 4BNH(C-1)/P and ring (P/C^2 - 1) * 2CBNH/P bytes per rank."""
    p, c = sp_size, ring_count
    n_q, n_kv, _ = shape.per_rank(p)
    s = shape.elem_bytes
    return {"collective": 4 * (c - 1) * n_q * s, "ring": (p // (c * c) - 1) * c * n_kv * s}


def kept_bytes_per_layer(
    *, batch: int, local_tokens: int, q_heads: int, kv_heads: int, head_dim: int, elem_bytes: int,
    ulysses_degree: int = 1, ring_size: int = 1, ring_count: int = 1, keep_team_q: bool = False,
    value_dim: int | None = None,
) -> int:
    """Pure: bytes one attention call keeps per rank from a checkpointed layer's first forward to its backward
    (the formulas of Note [Attention once under layer checkpointing] in docs/design/memory.md). ``local_tokens``: S_l,
    this rank's tokens; ``ring_size``: R, the WallFacer ranks (1: local attention inside); ``keep_team_q``:
    WallFacer's option, whose team q (C x the local q) is then kept too; ``value_dim``: v's and the output's head dim
    (None: ``head_dim``); log-sum-exps are fp32."""
    b, sl, hq, d, e, u = batch, local_tokens, q_heads, head_dim, elem_bytes, ulysses_degree
    dv = d if value_dim is None else value_dim
    inner = b * hq * sl * (dv * e + 4)  # output + fp32 lse of the own rows: hq/U heads over U*S_l tokens
    if keep_team_q and ring_size > 1:
        inner += ring_count * b * hq * sl * d * e
    if u == 1:
        return inner
    # head-sharded q, k, v (kv replicated when hk < U)
    received = b * sl * e * (hq * d + max(kv_heads, u) * (d + dv))
    return inner + received + b * sl * hq * dv * e  # + the output back in sequence shards
