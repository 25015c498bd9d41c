"""The direct-fetch schedule of a packed or windowed batch: which k/v rows this rank fetches from which owner, and
the kernel calls on them, as pure integer math (no torch). ``direct.py`` runs it.

A ring relays every k/v block to every rank whether or not its queries need it. With packed documents or a sliding
window most (query rank, key rank) pairs share no visible pair, and those that do need only part of the key shard:
the keys of the documents the queries are in, within the window's reach. Here each rank fetches exactly those rows
from their owner, and sends the dk/dv of them back to it (Note [Direct fetch]). The batch's documents are the same on
every rank, so both ends of every message derive it alike, with no handshake.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..comm.layout import RankLayout
from ..data.chunks import rank_chunks
from .blocks import KernelCall, block_calls, kernel_calls
from .documents import SequenceBatch
from .schedule import ring_steps
from .volume import AttnShape, SumDtypes, needed_positions, wallfacer_bytes

__all__ = ["FetchSchedule", "Send", "Source", "key_ranges", "needed", "pair_calls", "prefer_fetch"]

LOOKAHEAD = 2
"""Steps whose fetches are in flight ahead of the step being computed."""


@dataclass(frozen=True)
class Source:
    """The keys this rank fetches at ``step`` from the rank ``step`` places before it (sp index ``index``)."""

    step: int
    index: int
    ranges: tuple[tuple[int, int], ...]
    """Positions [lo, hi) of the owner's shard, sorted and disjoint; the received buffer is their concatenation."""
    calls: tuple[KernelCall, ...]
    """This rank's kernel calls on them; ``ks`` are positions in the received buffer."""

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


@dataclass(frozen=True)
class Send:
    """The rows of this rank's own shard the rank ``step`` places after it (sp index ``index``) fetches."""

    step: int
    index: int
    ranges: tuple[tuple[int, int], ...]

    @property
    def size(self) -> int:
        return sum(b - a for a, b in self.ranges)


@dataclass(frozen=True)
class FetchSchedule:
    """This rank's part of a direct-fetch exchange: its calls on its own shard, what it fetches at every step and
    what it sends (Note [Direct fetch]). Step s pairs rank i with i - s (it fetches) and i + s (it sends), the same
    on every rank, so the messages of every pair of ranks are issued in one order at both ends."""

    own: tuple[KernelCall, ...]
    sources: dict[int, Source]
    """By step (1..P-1): only the steps at which this rank fetches something."""
    sends: dict[int, Send]
    """By step: only the steps at which another rank fetches from this one."""
    sp_size: int
    chunk_len: int

    @classmethod
    def plan(
        cls, layout: RankLayout, index: int, *, sharding: str, causal: bool, batch: SequenceBatch,
        window: int | None, rows: int, local_len: int,
    ) -> "FetchSchedule":
        """The schedule of sequence-parallel rank ``index`` (arguments as ``RingSchedule.plan``)."""
        p = layout.ring_size
        chunks = rank_chunks(p, sharding, batch.assignment)
        m = len(chunks[index])
        if local_len % m:
            raise ValueError(f"{local_len} local tokens cannot be cut into the {m} chunks each rank holds")
        L = local_len // m
        calls = lambda i, j: pair_calls(chunks[i], chunks[j], causal=causal, chunk_len=L, rows=rows,  # noqa: E731
                                        batch=batch, window=window)
        sources, sends = {}, {}
        for s in range(1, p):
            src = (index - s) % p
            got = calls(index, src)
            if got:
                ranges = key_ranges(got)
                sources[s] = Source(s, src, ranges, tuple(_to_buffer(got, ranges)))
            dst = (index + s) % p
            theirs = calls(dst, index)
            if theirs:
                sends[s] = Send(s, dst, key_ranges(theirs))
        return cls(own=tuple(calls(index, index)), sources=sources, sends=sends, sp_size=p, chunk_len=L)

    @property
    def calls(self) -> list[KernelCall]:
        """Every kernel call in the order they run: own shard first, then the fetched blocks by step."""
        return [*self.own, *(c for s in sorted(self.sources) for c in self.sources[s].calls)]

    @property
    def fetched(self) -> int:
        """Key positions this rank fetches (each row of the batch: all rows travel together)."""
        return sum(x.size for x in self.sources.values())

    @property
    def sent(self) -> int:
        return sum(x.size for x in self.sends.values())


def pair_calls(
    q_chunks, k_chunks, *, causal: bool, chunk_len: int, rows: int, batch: SequenceBatch, window: int | None
) -> list[KernelCall]:
    """The kernel calls of one rank's queries (its sorted chunks ``q_chunks``) against another's keys."""
    return kernel_calls(q_chunks, k_chunks, block_calls(q_chunks, k_chunks, causal=causal), chunk_len=chunk_len,
                        rows=rows, docs=batch.documents, window=window, causal=causal)


def _key_spans(call: KernelCall) -> list[tuple[int, int]]:
    """The key ranges a call reads: its ``ks``, or its spans' (a varlen call's ``ks`` is their hull)."""
    if call.spans is None:
        return [(call.ks.start, call.ks.stop)]
    return [(call.ks.start + c, call.ks.start + d) for _, _, c, d in call.spans]


def key_ranges(calls: list[KernelCall]) -> tuple[tuple[int, int], ...]:
    """The union of the calls' key ranges as sorted disjoint [lo, hi) (touching ranges joined)."""
    out: list[list[int]] = []
    for a, b in sorted(r for c in calls for r in _key_spans(c)):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def _to_buffer(calls: list[KernelCall], ranges: tuple[tuple[int, int], ...]) -> list[KernelCall]:
    """The calls with ``ks`` moved from the owner's shard into the buffer of the fetched ``ranges``."""
    offsets, at = [], 0
    for a, b in ranges:
        offsets.append(at)
        at += b - a
    def moved(a: int, b: int) -> tuple[int, int]:
        r = next(i for i, (lo, hi) in enumerate(ranges) if lo <= a and b <= hi)
        shift = offsets[r] - ranges[r][0]
        return a + shift, b + shift

    out = []
    for c in calls:
        keys = [moved(a, b) for a, b in _key_spans(c)]  # order kept: the ranges are concatenated in order
        lo, hi = min(a for a, _ in keys), max(b for _, b in keys)
        spans = None if c.spans is None else tuple((qa, qb, a - lo, b - lo) for (qa, qb, _, _), (a, b)
                                                   in zip(c.spans, keys))
        out.append(replace(c, ks=slice(lo, hi), spans=spans))
    return out


def shards(layout: RankLayout, *, sharding: str, batch: SequenceBatch) -> tuple[tuple[int, ...], ...]:
    """The chunks every rank of the layout holds (the batch's balanced assignment, or ``sharding``'s)."""
    return rank_chunks(layout.ring_size, sharding, batch.assignment)


def needed(layout: RankLayout, *, sharding: str, causal: bool, batch: SequenceBatch, window: int | None,
           local_len: int) -> list[list[int]]:
    """``volume.needed_positions`` of this batch and layout: what each rank needs of each other's shard."""
    held = shards(layout, sharding=sharding, batch=batch)
    docs = batch.documents
    return _needed(None if docs is None else docs.starts, held, local_len // len(held[0]), causal, window,
                   None if docs is None else docs.spans)


@functools.lru_cache(maxsize=64)
def _needed(starts, held, chunk_len, causal, window, spans=None):
    return needed_positions(starts, shards=held, chunk_len=chunk_len, causal=causal, window=window, spans=spans)


@functools.lru_cache(maxsize=64)
def _fetched(layout: RankLayout, sharding: str, causal: bool, batch: SequenceBatch, window: int | None,
             local_len: int) -> tuple[int, ...]:
    """Key positions every rank fetches (all ranks' schedules: a few milliseconds at P = 64)."""
    return tuple(FetchSchedule.plan(layout, i, sharding=sharding, causal=causal, batch=batch, window=window, rows=1,
                                    local_len=local_len).fetched for i in range(layout.ring_size))


def prefer_fetch(
    layout: RankLayout, *, sharding: str, causal: bool, batch: SequenceBatch, window: int | None, local_len: int,
    shape: AttnShape, sums: SumDtypes, q_kept: bool = False, gather_out: bool = True,
) -> bool:
    """Pure: whether this batch runs the direct fetch rather than the ring / teams: with packed documents or a sliding
    window, always for C = 1 (it never moves more than the ring), and for C > 1 when the whole group sends fewer
    bytes that way (the same answer on every rank: it depends only on the batch and the layout)."""
    p, c = layout.ring_size, layout.ring_count
    if p == 1 or (batch.documents is None and window is None):
        return False
    if c == 1:
        return True
    fetched = _fetched(layout, sharding, causal, batch, window, local_len)
    steps = None
    if window is not None and batch.documents is None:
        steps = ring_steps(layout, sharding=sharding, causal=causal, window=window,
                           chunk_len=local_len // len(shards(layout, sharding=sharding, batch=batch)[0]),
                           assignment=batch.assignment)
    total = lambda d: sum(sum(kinds.values()) for kinds in d.values())  # noqa: E731
    row = shape.batch * shape.kv_heads * (shape.head_dim + shape.v_dim)
    fetch = sum(fetched) * row * (2 * shape.elem_bytes + sums.nbytes(shape.elem_bytes)[3])  # k/v twice, dk/dv once
    ring = sum(total(wallfacer_bytes(shape, sp_size=p, ring_count=c, local=layout.places[i].local,
                                     ring_steps=steps, sums=sums, q_kept=q_kept, gather_out=gather_out))
               for i in range(p))
    return fetch < ring


# Note [Direct fetch]: with packed documents or a sliding window, rank i's queries see only some keys of rank j's
# shard: those of the documents both hold (a document is an interval, so the keys of j's chunk that i's chunks can
# see form few runs), within the window's reach. ``pair_calls`` gives the kernel calls of the pair; the union of their
# key ranges is exactly what i needs from j (``key_ranges``; window tiles never span two runs of queries, so every
# fetched key is seen by some query: ``volume.needed_positions`` counts the same set independently). Step s of the
# exchange pairs every rank i with i - s (fetch) and i + s (serve): a permutation, so each rank sends and receives at
# most one message per step, and the pairs of a step are disjoint. All ranks walk the steps 1..P-1 in the same
# order and issue, for each, the k/v fetch (``LOOKAHEAD`` steps ahead of the computation; in forward, where only
# fetches travel and each pair's messages keep their order whatever the lookahead, further ahead while two shards'
# worth of rows are in flight, so a rank that needs few blocks has them all on the way before it computes its own
# and the rest of the steps are free) and, in backward, the
# dk/dv of the fetched rows back to their owner once the step's calls are done; a step with nothing to move is a no-op
# on that rank. So for every pair of ranks the messages between them are issued in the same order at both ends, as
# NCCL and gloo's tag matching need. Each fetched row travels once in forward and once in backward, and its dk/dv
# partial travels once, rounded once to ``dkv_home`` and summed by the owner in fp32 in step order: no relay, no
# running sum on the wire. Dense causal data (no documents, no window) keeps the ring, whose bytes are those of a
# dense exchange already; WallFacer C > 1 keeps its teams when the fetch would move more bytes (``prefer_fetch``).
