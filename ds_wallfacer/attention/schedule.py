"""The ring schedule: which kernel calls each ring step of WallFacer attention makes on one rank, as pure integer
math (no torch). ``wallfacer.py`` runs the calls; the calls of one block pair, split by documents and windows,
are ``blocks.py``'s (``kernel_calls``, which ``ulysses.py`` also plans its local calls with).

A team of C consecutive ranks holds two contiguous runs of chunks (zigzag) or one (contiguous); sorted by chunk
index, every (query team, key team) pair needs at most one block call: full, causal-diagonal or skipped
(docs/design/documents.md). With packed documents or a sliding window a block call splits into document segments and
window tiles (``blocks.py``), run as one varlen call for a block's diagonal segments and one for its off-diagonal
ones (``KernelCall.spans``), plus the window tiles; a window may cut the ring short (``ring_steps``). Such batches
normally run the direct fetch instead of the ring (``fetch.py``), with the same kernel calls.

The runtime plans its calls per pair of team members (query rows of member a against the keys of member b of the
held block), so that a call can start as soon as its two shards have arrived and a member's rows are final as soon
as its calls are done, in the order ``RingSchedule.plan`` gives (Note [Pipelined team exchanges]).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from ..comm.layout import RankLayout
from ..data.chunks import rank_chunks
from .blocks import BlockCall, KernelCall, block_calls, call_work, kernel_calls
from .documents import SequenceBatch

__all__ = ["RingSchedule", "attention_work", "pipeline_order", "ring_schedule", "ring_steps", "team_chunk_order"]


def team_chunk_order(
    team: Sequence[int], sp_size: int, scheme: str = "zigzag", *, assignment: Sequence[Sequence[int]] | None = None
) -> tuple[list[int], list[int]]:
    """For a team's all-gathered tokens (member by member, each member's chunks in local order):

    returns (``chunks``, ``perm``): the team's chunk ids sorted ascending, and for each sorted position the
    position in gathered order, so ``sorted = gathered[perm]`` at chunk granularity. ``assignment``: the chunks
    of every ring rank (a balanced sharding of a packed batch) instead of ``scheme``'s two.
    """
    held = rank_chunks(sp_size, scheme, assignment)
    gathered = [c for i in team for c in held[i]]
    perm = sorted(range(len(gathered)), key=gathered.__getitem__)
    return [gathered[p] for p in perm], perm


@dataclass(frozen=True)
class RingSchedule:
    """Static facts of one call on this rank: the kernel calls of every ring step, per pair of team members, in the
    order they run, and where the last step sends each member's finished rows (Note [Pipelined team exchanges])."""

    steps: list[list[KernelCall]]
    """Kernel calls of every ring step that runs (a sliding window may cut the ring short: ``ring_steps``), slices
    relative to one member's shard (``KernelCall.qm`` / ``km``)."""
    chunk_len: int
    home: tuple[tuple[int, ...], tuple[int, ...]]
    """(dests, sources) of the final dk/dv send home after the last step that runs (``RankLayout.home_peers``)."""
    sends_after: tuple[int, ...] = ()
    """For t = 1..C-1: how many calls of the last step run before the rows of member local + t are final (then
    they are sent to it: the forward's partial output, the backward's dq)."""
    home_after: tuple[int, ...] = ()
    """For m = 0..C-1: how many calls of the last step run before member m's slice of dk/dv is final and sent home
    (after the dq sends, in member order: a fixed order on every rank)."""

    @classmethod
    def plan(
        cls, layout: RankLayout, index: int, *, sharding: str, causal: bool, batch: SequenceBatch, window: int | None,
        rows: int, local_len: int,
    ) -> "RingSchedule":
        """The schedule of sequence-parallel rank ``index`` for ``rows`` batch rows of ``local_len`` tokens per
        rank, the documents and chunk assignment of ``batch``, and a sliding ``window`` (None: full)."""
        c, g, p = layout.ring_count, layout.group_size, layout.ring_size
        place = layout.places[index]
        held = rank_chunks(p, sharding, batch.assignment)  # every rank's chunks, once
        members = lambda team: list(held[team * c:(team + 1) * c])  # noqa: E731
        q_members = members(place.team)
        m = len(q_members[0])
        if local_len % m:
            raise ValueError(f"{local_len} local tokens cannot be cut into the {m} chunks each rank holds")
        L = local_len // m
        n_steps = g
        if window is not None and batch.documents is None:
            n_steps = ring_steps(layout, sharding=sharding, causal=causal, window=window, chunk_len=L, assignment=held)
        kv_group = (place.group + place.local) % c
        self_kv = place.local if kv_group == place.group else None  # my own shard is piece ``local`` of step 0
        steps, sends_after = [], ()
        for s in range(n_steps):
            k_members = members(kv_group * g + (place.pos - s) % g)
            pairs = {}
            for a, qc in enumerate(q_members):
                for b, kc in enumerate(k_members):
                    pairs[(a, b)] = kernel_calls(qc, kc, block_calls(qc, kc, causal=causal), chunk_len=L, rows=rows,
                                                 docs=batch.documents, window=window, qm=a, km=b, causal=causal)
            calls, after = pipeline_order(pairs, ring_count=c, local=place.local,
                                          self_kv=self_kv if s == 0 else None, first=s == 0, last=s == n_steps - 1)
            steps.append(calls)
            sends_after = after or sends_after
        home_after, at = [], sends_after[-1] if sends_after else 0
        for m in range(c):  # the last step's calls on member m's keys are done
            at = max([at] + [j + 1 for j, call in enumerate(steps[-1]) if call.km == m])
            home_after.append(at)
        return cls(steps=steps, chunk_len=L, home=layout.home_peers(index, n_steps), sends_after=sends_after,
                   home_after=tuple(home_after))

    def only_call(self, n: int, rows: int) -> KernelCall | None:
        """The single kernel call of a one-rank group when it covers every row, query and key without a mask: the
        group then runs exactly the kernel on the whole sequence."""
        if len(self.steps) != 1 or len(self.steps[0]) != 1:
            return None
        call = self.steps[0][0]
        full = slice(0, n)
        if (call.mask is not None or call.spans is not None or call.rows != slice(0, rows) or call.qs != full
                or call.ks != full):
            return None
        return call


def pipeline_order(
    pairs: dict[tuple[int, int], list[KernelCall]], *, ring_count: int, local: int, self_kv: int | None, first: bool,
    last: bool,
) -> tuple[list[KernelCall], tuple[int, ...]]:
    """Pure: the order of one ring step's calls (per (query member, key member) pair) and, in the last step, after
    how many calls each other member's rows are final (Note [Pipelined team exchanges]).

    At step 0 (``first``) the shards arrive one by one: the query shard of member local + t in team round t, the
    k/v piece of member b in skew round b (``self_kv``: the piece that is this rank's own, at hand); a pair is
    ready when both of its shards are. In the last step the other members' rows are finished first, member
    local + 1 first (the order of the sends), this rank's own last, so its calls hide the sends; when the last step
    is step 0 (G = 1) this rank's own rows against the first k/v piece come first, so that the first call waits for
    one shard at most."""
    c = ring_count
    remote_kv = [b for b in range(c) if b != self_kv]
    qpos = lambda a: (a - local) % c  # noqa: E731
    kvpos = lambda b: 0 if (not first or b == self_kv) else 1 + remote_kv.index(b)  # noqa: E731
    ready = lambda ab: max(qpos(ab[0]), kvpos(ab[1])) if first else 0  # noqa: E731
    keys = sorted(pairs, key=lambda ab: (ready(ab), qpos(ab[0]), kvpos(ab[1])))
    if not last or c == 1:
        return [call for ab in keys for call in pairs[ab]], ()
    order: list[KernelCall] = []
    done: set[tuple[int, int]] = set()

    def take(ab) -> None:
        order.extend(pairs[ab])
        done.add(ab)

    if first:  # own rows against the first k/v piece (this rank's own, or the first to arrive): one wait at most
        start = 0 if self_kv is not None else 1
        for ab in keys:
            if ab[0] == local and kvpos(ab[1]) == start:
                take(ab)
    after = []
    for t in range(1, c):
        for ab in keys:
            if ab[0] == (local + t) % c and ab not in done:
                take(ab)
        after.append(len(order))
    for ab in keys:
        if ab not in done:
            take(ab)
    return order, tuple(after)


def _ring_chunks(layout: RankLayout, index: int, *, sharding: str, assignment=None):
    """(sorted query chunks of the team, gathered->sorted permutation, (sorted key chunks, their team's
    permutation) of every ring step)."""
    c, g, p = layout.ring_count, layout.group_size, layout.ring_size
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
    the block-kernel calls of every ring step (the "full / diagonal / skipped" schedule, docs/design/documents.md)."""
    q_chunks, perm, k_steps = _ring_chunks(layout, index, sharding=sharding, assignment=assignment)
    return perm, [block_calls(q_chunks, k, causal=causal) for k, _ in k_steps]


def attention_work(layout: RankLayout, *, sharding: str, causal: bool, chunk_len: int = 1) -> list[int]:
    """Pure: score entries each rank computes in one forward (per batch and head), by rank index."""
    return [
        sum(call_work(call, chunk_len) for calls in ring_schedule(layout, i, sharding=sharding, causal=causal)[1]
            for call in calls)
        for i in range(layout.ring_size)
    ]


@functools.lru_cache(maxsize=64)
def ring_steps(layout: RankLayout, *, sharding: str, causal: bool, window: int, chunk_len: int, assignment=None) -> int:
    """Pure: ring steps a sliding window needs on the whole sub-ring group
    (Note [Ring steps under a sliding window]): one more than the last step at which ANY rank still has a visible
    query/key pair."""
    last = 0
    for i in range(layout.ring_size):
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
