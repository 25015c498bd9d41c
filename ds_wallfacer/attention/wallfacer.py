"""WallFacer multi-ring sequence-parallel attention (docs/design.md §2); C = 1 is plain ring attention.

Dimensions: B batch, hq / hk query / kv heads, d head dim, P sequence-parallel ranks, C ring count (team
size), G = P / C^2 ring steps, S_l = N / P tokens per rank (two chunks of L = S_l / 2), S_t = C * S_l
tokens per team. Tensors are [B, h, S, d] (the HF attention layout).

Forward, per call:
 1. all-gather q in the team                                      [B, h, S_l, d] -> [B, h, S_t, d]
 2. skewed gather: member j of team (g, t) receives the k/v of team (g + j, t) straight from its C
    members (point-to-point, overlapping step 1), so no team copy of k/v is ever made
 3. G ring steps: k/v move one hop along the sub-ring (double-buffered, overlapping the block kernel);
    (out, lse) merged into fp32 accumulators by log-sum-exp (``merge.merge_``)
 4. all-gather the partial lse in the team, weight the partial outputs, reduce-scatter them (in the input
    dtype by default: Note [Summed tensors on the wire])
Backward rotates k/v with their dk/dv accumulators (not q, dO, dq): with grouped-query attention this moves
hk/hq of the bytes, and it mirrors the forward. After the last step each dk/dv slice goes straight to its
owner (a skewed reduce-scatter). q, dO and out are gathered in the team in ONE collective (a kernel with
``backward_delta`` gets the fp32 delta = rowsum(dO * out) instead of out: 4 bytes per row rather than
d elements), and k/v are re-fetched by the skewed gather, so a layer keeps only its own shards (plus the
team's fp32 lse) between forward and backward. A one-rank group calls the kernel directly.
"""
from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..comm import CommLayer, RankLayout, WallFacerGroups
from ..data.chunks import SHARDINGS
from .checks import check_inputs_agree, local_error
from .documents import BatchDocuments, buffer_runs, global_ranges, segments, window_tiles
from .kernels import BlockKernel, get_kernel
from .kernels.base import expand_kv
from .merge import merge_
from .schedule import BlockCall, block_calls, call_work, team_chunk_order
from .volume import DEFAULT_SUM_DTYPES, SumDtypes

__all__ = ["SequenceBatch", "WallFacerAttention", "attention_work", "kernel_calls", "ring_schedule", "wallfacer_attention"]



@dataclass(eq=False)
class WallFacerAttention:
    """WallFacer attention over the sequence-parallel group in ``groups``; call it like a kernel:
    ``attn(q, k, v, causal=True)`` with this rank's shards in the layout of ``sharding``."""

    groups: WallFacerGroups
    comm: CommLayer = field(default_factory=CommLayer)
    kernel: str | BlockKernel = "auto"
    """Block kernel backend name (``kernels.KERNELS``), "auto", or a kernel object (a backend outside the
    registry, e.g. one with ``backward_delta``)."""
    sharding: str = "zigzag"
    """How the sequence was split across ranks ("zigzag" balances causal work)."""
    accum_comm_dtype: SumDtypes | torch.dtype | None = DEFAULT_SUM_DTYPES
    """dtype on the wire of the partial outputs and gradients summed across ranks: per tensor (``SumDtypes``;
    the default is measured, Note [Summed tensors on the wire]), one dtype for all, or None: the input dtype.
    Sums on a rank are fp32 whatever this says."""
    keep_team_q: bool = False
    """Keep the team's gathered q [B, hq, C*S_l, d] from the forward for the backward instead of gathering it
    again: (C-1) * B*hq*S_l*d elements fewer sent per rank and call, C x the local q held per layer from its forward
    to its backward (for every layer at once unless activation checkpointing recomputes the attention). Off by
    default: with hq = 4 hk and C = 4 that is 4 layer inputs' worth of q per layer."""
    check_inputs: bool = True
    """Validate shapes and dtypes across ranks (one small all-gather per new input signature)."""
    work: Counter = field(default_factory=Counter)
    """Attention score entries computed per batch and head, by phase."""
    _checked: set = field(default_factory=set, repr=False)
    _kernels: dict = field(default_factory=dict, repr=False)
    _schedules: dict = field(default_factory=dict, repr=False)
    """Ring schedules of the current batch (every layer shares them), by (causal, window, shape)."""

    @property
    def sum_dtypes(self) -> SumDtypes:
        """``accum_comm_dtype`` per summed tensor (what ``volume.wallfacer_bytes`` takes)."""
        a = self.accum_comm_dtype
        if isinstance(a, SumDtypes):
            return a
        return SumDtypes.uniform("input" if a is None else str(a).removeprefix("torch."))

    def wire_dtypes(self, dtype: torch.dtype) -> dict[str, torch.dtype]:
        """The torch dtype of each summed tensor (``SumDtypes`` field names) for inputs of ``dtype``."""
        sums = self.sum_dtypes
        return {name: dtype if (v := getattr(sums, name)) == "input" else getattr(torch, v)
                for name in ("out", "dq", "dkv_ring", "dkv_home")}

    @property
    def ring_count(self) -> int:
        """C: concurrent sub-rings (team size); ``wallfacer.ring_count`` of the config."""
        return self.groups.layout.ring_count

    @property
    def ring_steps(self) -> int:
        """G = R / C^2: ring steps per call (the sub-ring length)."""
        return self.groups.layout.group_size

    def block_kernel(self, q: torch.Tensor, *, mask: bool = False, softcap: bool = False) -> BlockKernel:
        """The block kernel for q's device and dtype and what the layer needs (a window mask, soft-capping),
        chosen once per combination."""
        if not isinstance(self.kernel, str):
            return self.kernel
        key = (q.device.type, q.dtype, mask, softcap)
        if key not in self._kernels:
            self._kernels[key] = get_kernel(self.kernel, q, mask=mask, softcap=softcap)
        return self._kernels[key]

    def __post_init__(self) -> None:
        if self.sharding not in SHARDINGS:
            raise ValueError(f"unknown sharding {self.sharding!r}; expected one of {SHARDINGS}")

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
        batch: "SequenceBatch | None" = None, window: int | None = None, softcap: float = 0.0,
    ) -> torch.Tensor:
        """``batch``: the documents and chunk assignment of a packed batch (None: one document per row, the
        layout's sharding); ``window``: the layer's sliding window (None: full); ``softcap``: logit soft-capping."""
        if self.check_inputs:
            self._check(q, k, v, causal)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        opts = _Options(batch=batch, window=window, softcap=float(softcap or 0.0))
        return _WallFacerFn.apply(q, k, v, self, causal, scale, opts)

    # -- validation ------------------------------------------------------------------------------
    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        check_inputs_agree(q, k, v, causal=causal, error=local_error(q, k, v), who="WallFacer attention",
                           comm=self.comm, group=self.groups.sp_group, checked=self._checked)


def wallfacer_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn: WallFacerAttention, *, causal: bool = True,
    scale: float | None = None, **options,
) -> torch.Tensor:
    """Functional form of ``attn(q, k, v, causal=..., scale=..., batch=..., window=..., softcap=...)``."""
    return attn(q, k, v, causal=causal, scale=scale, **options)


# -- layout helpers --------------------------------------------------------------------------------


def _to_team(g: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """Gathered [C, B, h, S_l, *r] (members in order, m chunks each) -> team order [B, h, S_t, *r] (chunks
    ascending); ``perm`` has C * m entries."""
    c, b, h, s = g.shape[:4]
    rest = g.shape[4:]
    m = len(perm) // c
    if c == 1 and perm == sorted(perm):  # one member, chunks already ascending: a view
        return g[0]
    x = g.reshape(c, b, h, m, s // m, *rest).movedim(0, 2).reshape(b, h, m * c, s // m, *rest)
    return x[:, :, perm].reshape(b, h, c * s, *rest)


def _from_team(x: torch.Tensor, perm: list[int], c: int) -> torch.Tensor:
    """Inverse of ``_to_team``: [B, h, S_t, *r] -> [C, B, h, S_l, *r]."""
    b, h, st = x.shape[:3]
    rest = x.shape[3:]
    n = len(perm)
    if c == 1 and perm == sorted(perm):
        return x.unsqueeze(0)
    inv = [0] * n
    for i, p in enumerate(perm):
        inv[p] = i
    y = x.reshape(b, h, n, st // n, *rest)[:, :, inv]
    return y.reshape(b, h, c, n // c, st // n, *rest).movedim(2, 0).reshape(c, b, h, st // c, *rest)


_merge = merge_
"""The old private name of ``merge.merge_`` (``ulysses.py`` imports it)."""


@dataclass(frozen=True)
class SequenceBatch:
    """What attention needs to know about the current batch beyond its tensors (built once per forward by the
    integration from the loader's ``document_ids`` / ``chunk_assignment``)."""

    documents: BatchDocuments | None = None
    """Packed documents (None: one document per row)."""
    assignment: tuple[tuple[int, ...], ...] | None = None
    """Chunks held by every ring rank (a balanced sharding); None: the layout's ``sharding``."""


@dataclass(frozen=True)
class _Options:
    batch: SequenceBatch | None
    window: int | None
    softcap: float


@dataclass(frozen=True)
class _KernelCall:
    """One kernel call of a ring step: batch rows, query and key buffer slices, and a window mask's global
    index ranges (None: no mask)."""

    rows: slice
    qs: slice
    ks: slice
    causal: bool
    mask: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] | None
    work: int


@dataclass(frozen=True)
class _RingSchedule:
    """Static facts of one call on this rank: chunk orders, peers, kernel calls per ring step."""

    perm: list[int]
    kv_perm: list[int]
    """``perm`` of the first k/v team (teams differ under a balanced assignment; zigzag's are all alike)."""
    home_perm: list[int]
    """``perm`` of the team whose k/v block is held after the last step run (where dk/dv go home)."""
    steps: list[list[_KernelCall]]
    """Kernel calls of every ring step that runs (a sliding window may cut the ring short: ``ring_steps``)."""
    chunk_len: int
    home: tuple[tuple[int, ...], tuple[int, ...]]
    """(dests, sources) of the final dk/dv send home after the last step that runs (``RankLayout.home_peers``)."""


def _ring_chunks(layout: RankLayout, index: int, *, sharding: str, assignment=None):
    """(sorted query chunks of the team, gathered->sorted permutation, (sorted key chunks, their team's
    permutation) of every ring step)."""
    c, g, p = layout.ring_count, layout.group_size, layout.sp_size
    place = layout.places[index]
    q_chunks, perm = team_chunk_order(range(place.team * c, (place.team + 1) * c), p, sharding, assignment=assignment)
    kv_group = (place.group + place.local) % c
    k_steps = []
    for s in range(g):
        kv_team = kv_group * g + (place.pos - s) % g
        k_steps.append(team_chunk_order(range(kv_team * c, (kv_team + 1) * c), p, sharding, assignment=assignment))
    return q_chunks, perm, k_steps


def ring_schedule(
    layout: RankLayout, index: int, *, sharding: str, causal: bool, assignment=None
) -> tuple[list[int], list[list[BlockCall]]]:
    """Pure: for sequence-parallel rank ``index``, the team-order permutation of its gathered chunks and
    the block-kernel calls of every ring step (the "full / diagonal / skipped" schedule, docs/design.md §2.2)."""
    q_chunks, perm, k_steps = _ring_chunks(layout, index, sharding=sharding, assignment=assignment)
    return perm, [block_calls(q_chunks, k, causal=causal) for k, _ in k_steps]


def attention_work(layout: RankLayout, *, sharding: str, causal: bool, chunk_len: int = 1) -> list[int]:
    """Pure: score entries each rank computes in one forward (per batch and head), by rank index."""
    return [
        sum(call_work(call, chunk_len) for calls in ring_schedule(layout, i, sharding=sharding, causal=causal)[1]
            for call in calls)
        for i in range(layout.sp_size)
    ]


def kernel_calls(
    q_chunks, k_chunks, calls: list[BlockCall], *, chunk_len: int, rows: int, docs: BatchDocuments | None,
    window: int | None,
) -> list[_KernelCall]:
    """The kernel calls of one ring step: one per block call, or, with packed documents or a sliding window,
    one per document segment (and window tile) that has a visible pair (``documents.py``)."""
    L, out = chunk_len, []
    if docs is None and window is None:
        for call in calls:
            out.append(_KernelCall(slice(0, rows), slice(call.q_lo * L, call.q_hi * L),
                                   slice(call.k_lo * L, call.k_hi * L), call.causal, None, rows * call_work(call, L)))
        return out
    docs = docs or BatchDocuments.single(seq_len=10**18, rows=rows)
    for call in calls:
        qc, kc = q_chunks[call.q_lo:call.q_hi], k_chunks[call.k_lo:call.k_hi]
        q_runs, k_runs = buffer_runs(qc, L), buffer_runs(kc, L)
        q0, k0 = call.q_lo * L, call.k_lo * L  # buffer offsets of the call inside the team / step buffer
        for seg in segments(qc, kc, chunk_len=L, causal=call.causal, docs=docs, window=window):
            r = slice(0, rows) if seg.row is None else slice(seg.row, seg.row + 1)
            n_rows = rows if seg.row is None else 1
            if not seg.windowed:
                sq, sk = seg.q_hi - seg.q_lo, seg.k_hi - seg.k_lo
                work = sq * (sq + 1) // 2 if seg.causal else sq * sk
                out.append(_KernelCall(r, slice(q0 + seg.q_lo, q0 + seg.q_hi), slice(k0 + seg.k_lo, k0 + seg.k_hi),
                                       seg.causal, None, n_rows * work))
                continue
            for t in window_tiles(seg, q_runs, k_runs, window=window):
                gq, gk = global_ranges(q_runs, t.q_lo, t.q_hi), global_ranges(k_runs, t.k_lo, t.k_hi)
                mask = (tuple(gq), tuple(gk)) if t.masked else None
                work = n_rows * (_masked_work(gq, gk, window) if t.masked else (t.q_hi - t.q_lo) * (t.k_hi - t.k_lo))
                out.append(_KernelCall(r, slice(q0 + t.q_lo, q0 + t.q_hi), slice(k0 + t.k_lo, k0 + t.k_hi),
                                       False, mask, work))
    return out


def _masked_work(gq, gk, window: int) -> int:
    """Visible pairs 0 <= i - j < window between global index ranges (closed form per pair of ranges)."""
    total = 0
    for qa, qb in gq:
        for ka, kb in gk:
            for i in range(qa, qb):  # per query: keys in [max(ka, i - window + 1), min(kb, i + 1))
                total += max(0, min(kb, i + 1) - max(ka, i - window + 1))
    return total


def _window_mask(spec, device: torch.device) -> torch.Tensor:
    """[Sq, Sk] bool: key j visible from query i iff 0 <= i - j < window (global indices)."""
    (gq, gk), window = spec
    qi = torch.cat([torch.arange(a, b, device=device) for a, b in gq]).unsqueeze(-1)
    kj = torch.cat([torch.arange(a, b, device=device) for a, b in gk])
    d = qi - kj
    return (d >= 0) & (d < window)


def _schedule(attn: WallFacerAttention, q: torch.Tensor, causal: bool, opts: _Options) -> _RingSchedule:
    batch = opts.batch or SequenceBatch()
    b, s_local = q.shape[0], q.shape[2]
    key = (causal, opts.window, b, s_local, id(batch))
    cache = attn._schedules
    if key in cache and cache[key][0] is batch:
        return cache[key][1]
    if any(k[4] != id(batch) for k in cache):
        cache.clear()  # a new batch: the previous batch's schedules are not needed again
    q_chunks, perm, k_steps = _ring_chunks(attn.groups.layout, attn.groups.place.index, sharding=attn.sharding,
                                           assignment=batch.assignment)
    m = len(perm) // attn.groups.layout.ring_count
    if s_local % m:
        raise ValueError(f"{s_local} local tokens cannot be cut into the {m} chunks each rank holds")
    L = s_local // m
    steps = [
        kernel_calls(q_chunks, k, block_calls(q_chunks, k, causal=causal), chunk_len=L, rows=b,
                     docs=batch.documents, window=opts.window)
        for k, _ in k_steps
    ]
    lay, index = attn.groups.layout, attn.groups.place.index
    n_steps = len(steps)
    if opts.window is not None and batch.documents is None:
        n_steps = ring_steps(lay, sharding=attn.sharding, causal=causal, window=opts.window, chunk_len=L,
                             assignment=batch.assignment)
    sched = _RingSchedule(perm=perm, kv_perm=k_steps[0][1], home_perm=k_steps[n_steps - 1][1], steps=steps[:n_steps],
                          chunk_len=L, home=lay.home_peers(index, n_steps))
    cache[key] = (batch, sched)
    return sched


@functools.lru_cache(maxsize=64)
def ring_steps(layout: RankLayout, *, sharding: str, causal: bool, window: int, chunk_len: int, assignment=None) -> int:
    """Pure: ring steps a sliding window needs on the whole sub-ring group (Note [Ring steps under a sliding
    window]): one more than the last step at which ANY rank still has a visible query/key pair."""
    last = 0
    for i in range(layout.sp_size):
        q_chunks, _, k_steps = _ring_chunks(layout, i, sharding=sharding, assignment=assignment)
        for s in range(len(k_steps) - 1, last, -1):
            calls = block_calls(q_chunks, k_steps[s][0], causal=causal)
            if kernel_calls(q_chunks, k_steps[s][0], calls, chunk_len=chunk_len, rows=1, docs=None, window=window):
                last = s
                break
    return last + 1


# Note [Ring steps under a sliding window]: k/v blocks travel one hop per step and every rank relays what it
# received, so a step can only be dropped when no rank needs it or any later step. Without documents the window
# makes that a static fact of the layout: the ring stops after ``ring_steps`` steps on every rank (no send, no
# receive, no kernel call for the rest), and in backward each rank sends the dk/dv of the block it holds at that
# point straight to its owners (``RankLayout.home_peers``). With contiguous sharding and a window no longer than
# a chunk, that is 2 steps for any P; zigzag holds an early and a late chunk per rank, so its last step is still
# needed and it saves only kernel calls. Skipping by documents is data-dependent: those blocks are still relayed.


def _block(x: torch.Tensor, call: _KernelCall, which: slice) -> torch.Tensor:
    return x[call.rows, :, which]


def _mask_of(call: _KernelCall, opts: _Options, device: torch.device) -> torch.Tensor | None:
    return None if call.mask is None else _window_mask((call.mask, opts.window), device)


# -- forward / backward ----------------------------------------------------------------------------

# Note [Summed tensors on the wire]: every sum on a rank is fp32 (block outputs merged by log-sum-exp; dq and the
# dk/dv of a block summed over the block's calls, query heads and ring steps). What is rounded is what crosses
# the wire: the lse-weighted partial outputs (forward reduce-scatter), the dq partials (backward reduce-scatter),
# the dk/dv accumulators passed along the sub-ring, and each lane's final dk/dv slice sent home.
# ``WallFacerAttention.accum_comm_dtype`` chooses each (``volume.SumDtypes``). The defaults were measured: bf16
# inputs, 8/2 heads, causal zigzag, max abs error against float64 as a multiple of the same kernel's error on the
# full sequence in one process (``launch/bench_precision.py``); a tensor travels in the input dtype where that
# stays within 2x, in fp32 where it does not. The partial outputs are weighted by exp(lse - lse_team) <= 1 before
# they are rounded, so they are bounded by the output's scale; dq partials and home slices are rounded once each
# and summed once; only the ring accumulator is a running sum rounded again at every hop, so its error grows with
# the ring length G and it stays fp32.
#
# Note [Gradients of grouped heads]: with hq > hk a kernel's dk/dv of one call is a sum over the hq/hk query heads
# of each kv head. Kernels that return the input dtype round that sum (flash-attn 2, cuDNN and CUDA SDPA round each
# head's share first, then the sum; PyTorch's CPU flash op loses more than one rounding too), and a block's dk/dv
# is a sum of P/C such calls, so bf16 dk/dv erred up to 1.74x the single-process kernel's here (2.0-2.35x in
# earlier measurements). Block calls of a multi-block backward therefore get k/v expanded to the query heads and
# the heads are summed in fp32 here, rounding once at the end. It costs the expanded k/v of one call (and 1.5x the
# CPU op's backward time: it is GQA-native); a kernel that sums heads in fp32 itself says so with
# ``reduces_heads_in_fp32 = True``. dq cannot be helped this way: a kernel rounds each block's dq to the input
# dtype, as every ring implementation built on such kernels does.
#
# Note [Backward without out]: a block kernel's backward uses out only through delta = rowsum(dO * out), one fp32
# number per query row. A kernel whose backward takes delta (``backward_delta(dout, q, k, v, delta, lse, *,
# causal, scale, mask=None, softcap=0.0)``, the ``backward`` contract with delta [B, hq, Sq] fp32 for out) lets the
# team all-gather carry delta instead of out: (C-1) * B*hq*S_l*4 bytes instead of (C-1) * B*hq*S_l*d*s, each rank
# forming delta for its own rows from its own dO and out. None of the registered backends can: PyTorch's CPU
# flash op, its CUDA flash / memory-efficient / cuDNN backward ops and flash-attn 2/3/4 all take out and compute
# delta in their own preprocessing kernel; the reference kernel computes it inline and could take it. Kernels
# that need out keep getting it.
#
# Note [No zero fills]: an accumulator starts uninitialised, and a static plan of the calls (``_fill_plan``)
# says which ranges of each call's result are written (first touch) and which are added (or merged), and which
# ranges no call touches (zeroed, or set to lse -inf). Calls on single batch rows (packed documents) fall back to
# a zero fill.


def _expand_grads(kernel: BlockKernel, q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether block backward calls get k/v expanded to the query heads (Note [Gradients of grouped heads])."""
    return (q.shape[1] != k.shape[1] and q.dtype not in (torch.float32, torch.float64)
            and not getattr(kernel, "reduces_heads_in_fp32", False))


def _block_grads(kernel: BlockKernel, expand: bool, do, q, k, v, out, lse, *, delta=None, **options):
    """One call's (dq, dk, dv); dk/dv fp32 sums over each kv head's query heads when ``expand``. ``delta``:
    rowsum(dO * out) for a kernel with ``backward_delta`` (then ``out`` is None)."""
    hq, hk = q.shape[1], k.shape[1]
    if expand:
        k, v = expand_kv(k, hq), expand_kv(v, hq)
    if delta is not None:
        dq, dk, dv = kernel.backward_delta(do, q, k, v, delta, lse, **options)
    else:
        dq, dk, dv = kernel.backward(do, q, k, v, out, lse, **options)
    if expand:  # [B, hq, S, d] -> [B, hk, hq/hk, S, d] -> fp32 sum over the group
        dk = dk.unflatten(1, (hk, hq // hk)).sum(2, dtype=torch.float32)
        dv = dv.unflatten(1, (hk, hq // hk)).sum(2, dtype=torch.float32)
    return dq, dk, dv


def _gaps(covered: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """Parts of [lo, hi) outside the sorted disjoint ``covered`` ranges."""
    out, at = [], lo
    for a, b in covered:
        if b <= at or a >= hi:
            continue
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < hi:
        out.append((at, hi))
    return out


def _cover(covered: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """``covered`` with [lo, hi) added, merged into sorted disjoint ranges."""
    out: list[tuple[int, int]] = []
    for a, b in sorted([*covered, (lo, hi)]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@functools.lru_cache(maxsize=4096)
def _fill_plan(spans: tuple[tuple[int, int, int, int], ...], rows: int, n: int):
    """Note [No zero fills]: for results of calls ``spans`` = (row_lo, row_hi, lo, hi) landing in order in an
    accumulator of ``rows`` batch rows and ``n`` positions, ((writes, adds) per span, untouched ranges); ranges are
    absolute [a, b). None when a span covers only some rows."""
    covered: list[tuple[int, int]] = []
    per_span = []
    for r0, r1, lo, hi in spans:
        if (r0, r1) != (0, rows):
            return None
        writes = _gaps(covered, lo, hi)
        adds = _gaps(writes, lo, hi)
        per_span.append((tuple(writes), tuple(adds)))
        covered = _cover(covered, lo, hi)
    return tuple(per_span), tuple(_gaps(covered, 0, n))


def _spans(calls, which: str) -> tuple[tuple[int, int, int, int], ...]:
    """(row_lo, row_hi, lo, hi) of each call's query (``which = "qs"``) or key range."""
    return tuple((c.rows.start, c.rows.stop, getattr(c, which).start, getattr(c, which).stop) for c in calls)


def _land(acc: torch.Tensor, x: torch.Tensor, lo: int, fill) -> None:
    """Write / add ``x`` (positions [lo, lo + len) along dim 2 of ``acc``) by ``fill`` = (writes, adds)."""
    writes, adds = fill
    for a, b in writes:
        acc[:, :, a:b].copy_(x[:, :, a - lo:b - lo])
    for a, b in adds:
        acc[:, :, a:b].add_(x[:, :, a - lo:b - lo])


def _fresh(shape, device, plan, *, fill: float = 0.0, dim: int = 2) -> torch.Tensor:
    """An fp32 accumulator: uninitialised except the ranges (along ``dim``) ``plan`` leaves untouched, or filled
    with ``fill`` throughout when there is no plan."""
    acc = torch.empty(shape, dtype=torch.float32, device=device)
    if plan is None:
        return acc.fill_(fill)
    for a, b in plan[1]:
        acc.narrow(dim, a, b - a).fill_(fill)
    return acc


def _only_call(sched: _RingSchedule, n: int, rows: int) -> _KernelCall | None:
    """The single kernel call of a one-rank group when it covers every row, query and key without a mask: the
    group then runs exactly the kernel on the whole sequence."""
    if len(sched.steps) != 1 or len(sched.steps[0]) != 1:
        return None
    call = sched.steps[0][0]
    full = slice(0, n)
    if call.mask is not None or call.rows != slice(0, rows) or call.qs != full or call.ks != full:
        return None
    return call if sched.perm == sorted(sched.perm) else None


def _gather_kv(attn, k: torch.Tensor, v: torch.Tensor):
    """Skewed all-gather: start receiving the C shards of this rank's first k/v team straight from its
    members, and sending this rank's own shard to the C ranks (one per lane) whose first team is ours."""
    place = attn.groups.place
    own = torch.stack([k, v])  # [2, B, hk, S_l, d]
    bufs = torch.empty((len(place.kv_sources), *own.shape), dtype=own.dtype, device=own.device)
    pending = attn.comm.exchange(
        [(own, dst) for dst in place.kv_dests], list(zip(bufs, place.kv_sources)), kind="skew", group=attn.groups.sp_group
    )
    return pending, bufs


def _team_kv(bufs: torch.Tensor, perm: list[int]) -> torch.Tensor:
    """[C, 2, B, hk, S_l, d] member shards -> [2, B, hk, S_t, d] in team order (one copy: k and v as 2B rows)."""
    c, two, b = bufs.shape[:3]
    x = _to_team(bufs.reshape(c, two * b, *bufs.shape[3:]), perm)  # [2B, hk, S_t, d]
    return x.reshape(two, b, *x.shape[1:])


def _all_gather_packed(comm: CommLayer, xs: list[torch.Tensor], group) -> list[torch.Tensor]:
    """One all-gather for tensors of any dtypes, packed as bytes: each [*s] -> [C, *s]."""
    flat = torch.cat([x.contiguous().view(-1).view(torch.uint8) for x in xs])
    g = comm.all_gather(flat, group)  # [C, total bytes]
    out, at = [], 0
    for x in xs:
        n = x.numel() * x.element_size()
        out.append(g[:, at:at + n].contiguous().view(x.dtype).view(g.shape[0], *x.shape))
        at += n
    return out


def _forward(attn, kernel: BlockKernel, sched: _RingSchedule, q, k, v, scale: float, opts: _Options):
    grp, comm, place = attn.groups, attn.comm, attn.groups.place
    c, p = grp.layout.ring_count, grp.layout.sp_size
    b, hq, sl, d = q.shape
    wire = attn.wire_dtypes(q.dtype)

    if p == 1:  # one rank: no collective; the kernel itself when one call covers everything
        call = _only_call(sched, sl, b)
        if call is not None:
            attn.work["forward"] += call.work
            return kernel.forward(q, k, v, causal=call.causal, scale=scale, softcap=opts.softcap)
        q_t = _to_team(q.unsqueeze(0), sched.perm)
        cur = _team_kv(torch.stack([k, v]).unsqueeze(0), sched.perm)
    else:
        # 1-2. skewed gather of k/v (point-to-point, in flight); team all-gather of q [B, h, S_l, d] -> [B, h, S_t, d]
        kv_pending, bufs = _gather_kv(attn, k, v)
        q_t = _to_team(comm.all_gather(q, grp.team_group), sched.perm)
        kv_pending.wait()
        cur = _team_kv(bufs, sched.kv_perm)  # [2, B, hk, S_t, d]
    # 3. ring steps, double-buffered; results land in fp32 accumulators (Note [No zero fills])
    plan = _fill_plan(_spans([call for calls in sched.steps for call in calls], "qs"), b, c * sl)
    acc_out = _fresh((b, hq, c * sl, d), q.device, plan)
    acc_lse = _fresh((b, hq, c * sl), q.device, plan, fill=float("-inf"))
    i = 0
    for s, calls in enumerate(sched.steps):
        pending = None
        if s + 1 < len(sched.steps):
            nxt = torch.empty_like(cur)
            pending = comm.exchange([(cur, place.ring_next)], [(nxt, place.ring_prev)], kind="ring", group=grp.sp_group)
        for call in calls:
            out, lse = kernel.forward(
                _block(q_t, call, call.qs), _block(cur[0], call, call.ks), _block(cur[1], call, call.ks),
                causal=call.causal, scale=scale, mask=_mask_of(call, opts, q.device), softcap=opts.softcap,
            )
            if plan is None:
                merge_(acc_out[call.rows, :, call.qs], acc_lse[call.rows, :, call.qs], out, lse)
            else:
                writes, adds = plan[0][i]
                lo = call.qs.start
                for a, z in writes:
                    acc_out[:, :, a:z].copy_(out[:, :, a - lo:z - lo])
                    acc_lse[:, :, a:z].copy_(lse[:, :, a - lo:z - lo])
                for a, z in adds:
                    merge_(acc_out[:, :, a:z], acc_lse[:, :, a:z], out[:, :, a - lo:z - lo], lse[:, :, a - lo:z - lo])
            i += 1
            attn.work["forward"] += call.work
        if pending is not None:
            cur = pending.wait()[0]
    if c == 1:  # a team of one: the accumulator is the output (and q_t is q)
        return _from_team(acc_out, sched.perm, 1)[0].to(q.dtype), acc_lse
    # 4. lse-weighted reduce-scatter in the team: [B, hq, S_t, d] -> [C, B, hq, S_l, d] -> own [B, hq, S_l, d]
    lse_all = comm.all_gather(acc_lse, grp.team_group)  # [C, B, hq, S_t]
    lse_team = torch.logsumexp(lse_all, dim=0)
    finite = torch.where(torch.isinf(lse_team), torch.zeros_like(lse_team), lse_team)  # rows that see no key
    part = acc_out.mul_(torch.exp(acc_lse - finite).unsqueeze(-1)).to(wire["out"])  # each <= the output's scale
    out = comm.reduce_scatter(_from_team(part, sched.perm, c), grp.team_group).to(q.dtype)
    return (out, lse_team, q_t) if attn.keep_team_q else (out, lse_team)


def _backward(
    attn, kernel: BlockKernel, sched: _RingSchedule, dout, q, k, v, out, lse_team, scale: float, opts: _Options,
    q_team: torch.Tensor | None = None,
):
    """dq, dk, dv; ``q_team``: the team's q kept from the forward (``keep_team_q``), else gathered again."""
    grp, comm, place = attn.groups, attn.comm, attn.groups.place
    c, p = grp.layout.ring_count, grp.layout.sp_size
    b, hq, sl, d = q.shape
    wire = attn.wire_dtypes(q.dtype)
    dout = dout.to(q.dtype)
    delta_path = callable(getattr(kernel, "backward_delta", None))

    if p == 1:
        call = _only_call(sched, sl, b)
        if call is not None:  # exactly the kernel on the whole sequence
            attn.work["backward"] += call.work
            dq, dk, dv = kernel.backward(dout, q, k, v, out, lse_team, causal=call.causal, scale=scale,
                                         softcap=opts.softcap)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        q_t, do_t = (_to_team(x.unsqueeze(0), sched.perm) for x in (q, dout))
        o_t = _to_team(out.unsqueeze(0), sched.perm)
        cur = _team_kv(torch.stack([k, v]).unsqueeze(0), sched.perm)
        delta_path = False
    else:
        # 1-2. skewed gather of k/v again; ONE team all-gather of q (unless kept), dO (the adjoint of the forward
        # reduce-scatter) and out, or only the fp32 delta = rowsum(dO * out) [B, hq, S_l] for a kernel that takes it
        kv_pending, bufs = _gather_kv(attn, k, v)
        last_piece = (dout.float() * out.float()).sum(-1) if delta_path else out
        pieces = ([] if q_team is not None else [q]) + [dout, last_piece]
        gathered = [_to_team(x, sched.perm) for x in _all_gather_packed(comm, pieces, grp.team_group)]
        q_t = q_team if q_team is not None else gathered.pop(0)
        do_t, o_t = gathered
        kv_pending.wait()
        cur = _team_kv(bufs, sched.kv_perm)
    # 3. ring: k/v move ahead; dk/dv of the held block follow one step behind, then go home
    expand = _expand_grads(kernel, q, k)
    dq_plan = _fill_plan(_spans([call for calls in sched.steps for call in calls], "qs"), b, c * sl)
    dq_acc = _fresh((b, hq, c * sl, d), q.device, dq_plan)
    dkv_pending = None
    last = len(sched.steps) - 1
    i = 0
    for s, calls in enumerate(sched.steps):
        kv_pending = None
        if s < last:
            nxt = torch.empty_like(cur)
            kv_pending = comm.exchange([(cur, place.ring_next)], [(nxt, place.ring_prev)], kind="ring", group=grp.sp_group)
        kv_plan = _fill_plan(_spans(calls, "ks"), b, cur.shape[3])
        dkv = _fresh(cur.shape, q.device, kv_plan, dim=3)  # [2, B, hk, S_t, d]
        for j, call in enumerate(calls):
            qs, ks, rows = call.qs, call.ks, call.rows
            dq, dk, dv = _block_grads(
                kernel, expand, do_t[rows, :, qs], q_t[rows, :, qs], cur[0][rows, :, ks], cur[1][rows, :, ks],
                None if delta_path else o_t[rows, :, qs], lse_team[rows, :, qs],
                delta=o_t[rows, :, qs] if delta_path else None, causal=call.causal, scale=scale,
                mask=_mask_of(call, opts, q.device), softcap=opts.softcap,
            )
            if dq_plan is None:
                dq_acc[rows, :, qs] += dq
            else:
                _land(dq_acc, dq, qs.start, dq_plan[0][i])
            if kv_plan is None:
                dkv[0][rows, :, ks] += dk
                dkv[1][rows, :, ks] += dv
            else:
                _land(dkv[0], dk, ks.start, kv_plan[0][j])
                _land(dkv[1], dv, ks.start, kv_plan[0][j])
            i += 1
            attn.work["backward"] += call.work
        if p == 1:  # one step, nothing to send or receive
            dk_own, dv_own = (_from_team(x, sched.perm, 1)[0] for x in dkv)
            return _from_team(dq_acc, sched.perm, 1)[0].to(q.dtype), dk_own.to(k.dtype), dv_own.to(v.dtype)
        if dkv_pending is not None:
            dkv += dkv_pending.wait()[0]
        if s < last:
            send = dkv.to(wire["dkv_ring"])
            recv = torch.empty_like(send)
            dkv_pending = comm.exchange([(send, place.ring_next)], [(recv, place.ring_prev)], kind="ring",
                                        group=grp.sp_group)
        else:  # skewed reduce-scatter: each member of the block's team gets its slice, one per lane
            send = dkv.to(wire["dkv_home"])
            slices = torch.stack([_from_team(send[0], sched.home_perm, c), _from_team(send[1], sched.home_perm, c)], dim=1)
            homes = torch.empty_like(slices)  # [C, 2, B, hk, S_l, d]
            dkv_pending = comm.exchange(list(zip(slices, sched.home[0])), list(zip(homes, sched.home[1])),
                                        kind="skew", group=grp.sp_group)
        if kv_pending is not None:
            cur = kv_pending.wait()[0]
    # 4. sum the lanes' dk/dv of this rank's shard in fp32; reduce-scatter dq in the team (adjoint of the all-gather)
    dkv_own = torch.stack(dkv_pending.wait()).sum(dim=0, dtype=torch.float32)  # [2, B, hk, S_l, d]
    if c == 1:
        dq = _from_team(dq_acc, sched.perm, 1)[0]
    else:
        dq = comm.reduce_scatter(_from_team(dq_acc.to(wire["dq"]), sched.perm, c), grp.team_group)
    return dq.to(q.dtype), dkv_own[0].to(k.dtype), dkv_own[1].to(v.dtype)


class _WallFacerFn(torch.autograd.Function):
    """The autograd node of one WallFacer call. Inside a checkpointed layer (``residuals.py``) the first forward
    keeps (out, lse_team, and the team's q with ``keep_team_q``) and the recompute returns them: no block kernel, no
    collective, nothing counted twice; q, k, v come from the layer's recompute either way (the same values)."""

    @staticmethod
    def forward(ctx, q, k, v, attn: WallFacerAttention, causal: bool, scale: float, opts: _Options):
        from .residuals import residual_slot, tensor_key

        kernel = attn.block_kernel(q, mask=opts.window is not None, softcap=bool(opts.softcap))
        sched = _schedule(attn, q, causal, opts)
        slot = residual_slot("wallfacer", attn, tensor_key(q, k, v), causal, scale, opts)
        if slot is not None and slot.replaying:
            out, lse_team, *kept = slot.take()
        else:
            with torch.no_grad(), attn.comm.phase("forward"):
                out, lse_team, *kept = _forward(attn, kernel, sched, q, k, v, scale, opts)
            if slot is not None:
                slot.keep(out, lse_team, *kept)
        ctx.save_for_backward(q, k, v, out, lse_team, *kept)  # kept: the team's q (``keep_team_q``)
        ctx.attn, ctx.kernel, ctx.sched, ctx.scale, ctx.opts, ctx.slot = attn, kernel, sched, scale, opts, slot
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse_team, *kept = ctx.saved_tensors
        with torch.no_grad(), ctx.attn.comm.phase("backward"):
            dq, dk, dv = _backward(ctx.attn, ctx.kernel, ctx.sched, dout, q, k, v, out, lse_team, ctx.scale, ctx.opts,
                                   *kept)
        if ctx.slot is not None:
            ctx.slot.done()
        return dq, dk, dv, None, None, None, None
