"""The ring schedule: which kernel calls each ring step of WallFacer attention makes on one rank, as pure integer
math (no torch). ``wallfacer.py`` runs the calls; ``ulysses.py`` plans its local calls with ``kernel_calls``.

A team of C consecutive ranks holds two contiguous runs of chunks (zigzag) or one (contiguous); sorted by chunk
index, every (query team, key team) pair needs at most one block call: full, causal-diagonal or skipped
(docs/design.md §2.2). With packed documents or a sliding window a block call splits into one kernel call per
document segment and window tile (``documents.py``), and a window may cut the ring short (``ring_steps``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from ..comm.layout import RankLayout
from ..data.chunks import chunk_ids
from .documents import BatchDocuments, SequenceBatch, buffer_runs, global_ranges, segments, window_tiles

__all__ = [
    "BlockCall", "KernelCall", "RingSchedule", "attention_work", "block_calls", "call_work", "kernel_calls",
    "ring_schedule", "ring_steps", "team_chunk_order",
]


def team_chunk_order(
    team: Sequence[int], sp_size: int, scheme: str = "zigzag", *, assignment: Sequence[Sequence[int]] | None = None
) -> tuple[list[int], list[int]]:
    """For a team's all-gathered tokens (member by member, each member's chunks in local order):

    returns (``chunks``, ``perm``): the team's chunk ids sorted ascending, and for each sorted position the
    position in gathered order, so ``sorted = gathered[perm]`` at chunk granularity. ``assignment``: the chunks
    of every ring rank (a balanced sharding of a packed batch) instead of ``scheme``'s two.
    """
    gathered = [c for i in team for c in (assignment[i] if assignment is not None else chunk_ids(i, sp_size, scheme))]
    perm = sorted(range(len(gathered)), key=gathered.__getitem__)
    return [gathered[p] for p in perm], perm


@dataclass(frozen=True)
class BlockCall:
    """One block-kernel call: sorted query chunks [q_lo, q_hi) against sorted key chunks [k_lo, k_hi)."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool
    """Causal inside the call: only when the query and key chunks are the same run."""


def block_calls(q_chunks: Sequence[int], k_chunks: Sequence[int], *, causal: bool) -> list[BlockCall]:
    """The kernel calls for sorted query chunks against sorted key chunks.

    Non-causal: one full call. Causal: identical chunk lists give one causal call (positions ascend, so the
    mask of the concatenation is exactly the global causal mask); disjoint lists give full calls, one per run
    of queries that see the same prefix of keys (chunks below them); pairs with no visible key are skipped.
    """
    nq, nk = len(q_chunks), len(k_chunks)
    if not causal:
        return [BlockCall(0, nq, 0, nk, False)]
    if list(q_chunks) == list(k_chunks):
        return [BlockCall(0, nq, 0, nk, True)]
    if set(q_chunks) & set(k_chunks):
        raise ValueError(f"query chunks {q_chunks} and key chunks {k_chunks} partly overlap")
    calls: list[BlockCall] = []
    for qi, c in enumerate(q_chunks):
        seen = sum(1 for k in k_chunks if k < c)  # sorted keys: the visible ones are a prefix
        if seen == 0:
            continue
        if calls and calls[-1].k_hi == seen and calls[-1].q_hi == qi:
            last = calls[-1]
            calls[-1] = BlockCall(last.q_lo, qi + 1, 0, seen, False)
        else:
            calls.append(BlockCall(qi, qi + 1, 0, seen, False))
    return calls


def call_work(call: BlockCall, chunk_len: int) -> int:
    """Attention score entries a call computes (query-key pairs), for balance reports."""
    sq, sk = (call.q_hi - call.q_lo) * chunk_len, (call.k_hi - call.k_lo) * chunk_len
    return sq * (sq + 1) // 2 if call.causal else sq * sk


@dataclass(frozen=True)
class KernelCall:
    """One kernel call of a ring step: batch rows, query and key buffer slices, and a window mask's global
    index ranges (None: no mask)."""

    rows: slice
    qs: slice
    ks: slice
    causal: bool
    mask: tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] | None
    work: int


@dataclass(frozen=True)
class RingSchedule:
    """Static facts of one call on this rank: chunk orders, peers, kernel calls per ring step."""

    perm: list[int]
    kv_perm: list[int]
    """``perm`` of the first k/v team (teams differ under a balanced assignment; zigzag's are all alike)."""
    home_perm: list[int]
    """``perm`` of the team whose k/v block is held after the last step run (where dk/dv go home)."""
    steps: list[list[KernelCall]]
    """Kernel calls of every ring step that runs (a sliding window may cut the ring short: ``ring_steps``)."""
    chunk_len: int
    home: tuple[tuple[int, ...], tuple[int, ...]]
    """(dests, sources) of the final dk/dv send home after the last step that runs (``RankLayout.home_peers``)."""

    @classmethod
    def plan(
        cls, layout: RankLayout, index: int, *, sharding: str, causal: bool, batch: SequenceBatch, window: int | None,
        rows: int, local_len: int,
    ) -> "RingSchedule":
        """The schedule of sequence-parallel rank ``index`` for ``rows`` batch rows of ``local_len`` tokens per
        rank, the documents and chunk assignment of ``batch``, and a sliding ``window`` (None: full)."""
        q_chunks, perm, k_steps = _ring_chunks(layout, index, sharding=sharding, assignment=batch.assignment)
        m = len(perm) // layout.ring_count
        if local_len % m:
            raise ValueError(f"{local_len} local tokens cannot be cut into the {m} chunks each rank holds")
        L = local_len // m
        steps = [
            kernel_calls(q_chunks, k, block_calls(q_chunks, k, causal=causal), chunk_len=L, rows=rows,
                         docs=batch.documents, window=window)
            for k, _ in k_steps
        ]
        n_steps = len(steps)
        if window is not None and batch.documents is None:
            n_steps = ring_steps(layout, sharding=sharding, causal=causal, window=window, chunk_len=L,
                                 assignment=batch.assignment)
        return cls(perm=perm, kv_perm=k_steps[0][1], home_perm=k_steps[n_steps - 1][1], steps=steps[:n_steps],
                   chunk_len=L, home=layout.home_peers(index, n_steps))

    def only_call(self, n: int, rows: int) -> KernelCall | None:
        """The single kernel call of a one-rank group when it covers every row, query and key without a mask: the
        group then runs exactly the kernel on the whole sequence."""
        if len(self.steps) != 1 or len(self.steps[0]) != 1:
            return None
        call = self.steps[0][0]
        full = slice(0, n)
        if call.mask is not None or call.rows != slice(0, rows) or call.qs != full or call.ks != full:
            return None
        return call if self.perm == sorted(self.perm) else None


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
) -> list[KernelCall]:
    """The kernel calls of one ring step: one per block call, or, with packed documents or a sliding window,
    one per document segment (and window tile) that has a visible pair (``documents.py``)."""
    L, out = chunk_len, []
    if docs is None and window is None:
        for call in calls:
            out.append(KernelCall(slice(0, rows), slice(call.q_lo * L, call.q_hi * L),
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
                out.append(KernelCall(r, slice(q0 + seg.q_lo, q0 + seg.q_hi), slice(k0 + seg.k_lo, k0 + seg.k_hi),
                                      seg.causal, None, n_rows * work))
                continue
            for t in window_tiles(seg, q_runs, k_runs, window=window):
                gq, gk = global_ranges(q_runs, t.q_lo, t.q_hi), global_ranges(k_runs, t.k_lo, t.k_hi)
                mask = (tuple(gq), tuple(gk)) if t.masked else None
                work = n_rows * (_masked_work(gq, gk, window) if t.masked else (t.q_hi - t.q_lo) * (t.k_hi - t.k_lo))
                out.append(KernelCall(r, slice(q0 + t.q_lo, q0 + t.q_hi), slice(k0 + t.k_lo, k0 + t.k_hi),
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


@functools.lru_cache(maxsize=64)
def ring_steps(layout: RankLayout, *, sharding: str, causal: bool, window: int, chunk_len: int, assignment=None) -> int:
    """Pure: ring steps a sliding window needs on the whole sub-ring group
    (Note [Ring steps under a sliding window]): one more than the last step at which ANY rank still has a visible
    query/key pair."""
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
