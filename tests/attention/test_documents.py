"""Packed documents, bidirectional spans, sliding windows and soft-capping in every sequence-parallel mode, against
a float64 single-process attention that never lets a token see another document (and applies the spans, the window,
the cap).

One launch per P runs every mode and case: WallFacer C = 1 and 2, Ulysses, hybrid; documents that straddle rank
boundaries, a document longer than a rank's shard, a batch row that is a single document; windows shorter than a
chunk and longer than a shard; soft-capping with the reference kernel; bidirectional spans at position 0, across
chunk and rank boundaries, several per row, in packed documents, under a window shorter than a span, with balanced
sharding, and on the ring / teams as well as the direct fetch. Also the pure segment math.
"""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.attention.blocks import buffer_runs, segments, window_tiles
from ds_wallfacer.attention.documents import BatchDocuments
from tests.dist_utils import run_distributed

SEQ_PER_RANK = 16


def test_segments_split_calls_by_document_and_skip_cross_document_pairs() -> None:
    docs = BatchDocuments(starts=((0, 5, 40),), seq_len=64)  # documents [0,5) [5,40) [40,64)
    # chunks of 8: queries = chunks 4, 5 (tokens 32..47), keys = chunks 0, 1 (tokens 0..15): only document 1 shared
    segs = segments([4, 5], [0, 1], chunk_len=8, causal=False, docs=docs)
    assert [(s.q_lo, s.q_hi, s.k_lo, s.k_hi) for s in segs] == [(0, 8, 5, 16)]
    # a diagonal call over non-adjacent chunks 0 and 7 (zigzag): each document is one causal buffer range
    segs = segments([0, 7], [0, 7], chunk_len=8, causal=True, docs=docs)
    assert [(s.q_lo, s.q_hi, s.causal) for s in segs] == [(0, 5, True), (5, 8, True), (8, 16, True)]
    # a window of 4: keys 16+ tokens before every query are skipped, nearer ones are masked tiles
    assert segments([4], [0], chunk_len=8, causal=False, docs=docs, window=4) == []
    seg, = segments([2], [1], chunk_len=8, causal=False, docs=BatchDocuments.single(64), window=4)
    tiles = window_tiles(seg, buffer_runs([2], 8), buffer_runs([1], 8), window=4, tile=4)
    assert [(t.q_lo, t.q_hi, t.k_lo, t.k_hi, t.masked) for t in tiles] == [(0, 4, 5, 8, True)]


def _docs_for(n: int, case: int) -> list[list[int]]:
    """Two rows of document lengths summing to n: many documents straddling rank boundaries, one longer than a
    shard; and a single document (or a short one and a long one)."""
    g = torch.Generator().manual_seed(case)
    row, left = [], n
    while left:
        x = min(left, int(torch.randint(1, max(2, n // 5), (1,), generator=g)))
        row.append(x)
        left -= x
    long = [3, n - 3] if case % 2 else [n]
    return [row, long]


def _modes(world: int):
    yield "wallfacer", 1, 1
    if world % 4 == 0:
        yield "wallfacer", 1, 2
    yield "ulysses", world, 1
    if world >= 4:
        yield "hybrid", 2, 2 if world == 8 else 1


def _span_cases(n: int) -> list[tuple]:
    """(window, balanced, force the ring, document lengths, spans per row): spans at 0, across chunks (L = n / 2P)
    and ranks, several per row; then in packed documents under a window shorter than a span, balanced; then the
    first again on the ring and teams instead of the direct fetch (``fetch.prefer_fetch`` chooses the fetch here)."""
    chunk, third = n // (2 * n // SEQ_PER_RANK), n // 3
    single = ([[n], [n]], [[(0, 3 * chunk + 3)], [(chunk - 2, 2 * chunk + 5), (2 * chunk + 5, 2 * chunk + 9),
                                                 (n - chunk + 1, n - 1)]])
    packed = ([[third, n - third], [n // 2, n // 2]],
              [[(1, third - 2), (third + 4, min(n, third + 3 * chunk))], [(5, n // 2 - 1), (n // 2 + 2, n // 2 + 9)]])
    return [(None, False, False, *single), (5, False, False, *packed), (3 * chunk // 2, True, False, *packed),
            (None, False, True, *single)]


def _references(world: int) -> list[tuple]:
    """Per case: (window, softcap, packed, balanced, spans, ring), the document lengths, the full inputs and the
    float64 reference. Computed once here, not once per rank and mode."""
    from tests.attention.reference import document_mask, full_inputs, reference_attention, span_mask

    n = SEQ_PER_RANK * world
    refs = []
    for i, (window, softcap, packed, balanced) in enumerate([
        (None, 0.0, True, False), (5, 0.0, True, False), (n // 3, 0.0, False, False), (None, 30.0, True, False),
        (3 * SEQ_PER_RANK // 2, 20.0, True, False), (None, 0.0, True, True), (7, 0.0, True, True),
    ]):
        lengths = _docs_for(n, i) if packed else [[n], [n]]
        q, k, v, do = full_inputs(batch=2, q_heads=8, kv_heads=2, seq_len=n, head_dim=16, dtype=torch.float32, seed=i)
        want = reference_attention(q, k, v, do, causal=True, scale=SCALE, softcap=softcap,
                                   keep=document_mask(lengths, window=window))
        refs.append(((window, softcap, packed, balanced, None, False), lengths, (q, k, v, do), want))
    for i, (window, balanced, ring, lengths, spans) in enumerate(_span_cases(n)):
        q, k, v, do = full_inputs(batch=2, q_heads=8, kv_heads=2, seq_len=n, head_dim=16, dtype=torch.float32,
                                  seed=10 + i)
        want = reference_attention(q, k, v, do, causal=False, scale=SCALE, keep=span_mask(lengths, spans,
                                                                                          window=window))
        refs.append(((window, 0.0, True, balanced, spans, ring), lengths, (q, k, v, do), want))
    return refs


SCALE = 2.5 / 4  # large logits, so the cap matters


def _run(rank: int, world: int, refs: list[tuple]) -> list[dict]:
    from ds_wallfacer.attention import wallfacer
    from ds_wallfacer.attention.documents import SequenceBatch
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.planner.auto import ParallelSetup
    from ds_wallfacer.data.loader import shard_sequence
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel

    n = SEQ_PER_RANK * world
    out = []
    for mode, u, c in _modes(world):
        dims = ParallelDims(world_size=world, sp_size=world, mode=mode, ulysses_degree=u, ring_count=c, num_heads=8,
                            num_kv_heads=2)
        lay = ParallelSetup(dims, kernel="reference")
        groups = build_sequence_parallel(lay)
        attn = attention_for(groups, comm=CommLayer())
        for (window, softcap, packed, balanced, spans, ring), lengths, (q, k, v, do), want in refs:
            if ring and c == 1:
                continue
            assignment = None
            if balanced:  # the loader's cost-aware layout: 4 chunks per ring rank, assigned by document work
                from ds_wallfacer.data.balance import balanced_assignment

                assignment = balanced_assignment(lengths, sp_size=world // u, chunks_per_rank=4)
            scale = SCALE
            sh = lambda x: shard_sequence(x, dim=2, index=groups.shard_index, sp_size=world,  # noqa: E731
                                          ulysses_degree=u, scheme="zigzag", assignment=assignment)
            starts = tuple(tuple(int(s) for s in torch.tensor([0] + r[:-1]).cumsum(0)) for r in lengths)
            docs = BatchDocuments(starts=starts, seq_len=n,
                                  spans=None if spans is None else tuple(tuple(r) for r in spans))
            batch = SequenceBatch(documents=docs, assignment=assignment) if packed else None
            ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
            if ring:  # the ring / teams with spans, which the byte rule would not choose for this batch
                wallfacer.prefer_fetch, chosen = (lambda *a, **kw: False), wallfacer.prefer_fetch
            try:
                o = attn(ql, kl, vl, causal=True, scale=scale, batch=batch, window=window, softcap=softcap)
                o.backward(sh(do))
            finally:
                if ring:
                    wallfacer.prefer_fetch = chosen
            errs = [(a.double() - sh(b)).abs().max().item() for a, b in zip((o, ql.grad, kl.grad, vl.grad), want)]
            with torch.no_grad():  # control: the same call without the documents / window (spans) must differ
                plain = attn(ql, kl, vl, causal=True, scale=scale, softcap=softcap,
                             batch=SequenceBatch(assignment=assignment) if balanced else None) if spans is None else \
                    attn(ql, kl, vl, causal=True, scale=scale, window=window,
                         batch=SequenceBatch(documents=docs.without_spans(), assignment=assignment))
            control = (plain.double() - sh(want[0])).abs().max().item()
            out.append(dict(mode=mode, u=u, c=c, window=window, softcap=softcap, packed=packed, balanced=balanced,
                            spans=spans is not None, ring=ring, errs=errs, control=control))
    return out


@pytest.mark.parametrize("world", [2, 4, 8])
def test_documents_windows_softcap_match_single_process(world: int) -> None:
    results = run_distributed(_run, world, _references(world), timeout_s=600)
    for rank, res in enumerate(results):
        for r in res:
            # fp32 against float64; logits at 2.5x the usual scale (so soft-capping bites), gradients up to ~10
            assert max(r["errs"]) <= 5e-5, f"P={world} rank {rank}: {r}"
            assert r["control"] > 1e-2 or r["spans"], f"P={world} rank {rank}: documents / window changed nothing: {r}"
    for case in zip(*results):  # spans change some rank's rows (not every rank holds a span's query)
        assert max(r["control"] for r in case) > 1e-2 or not case[0]["spans"], f"P={world}: spans changed nothing"


def _window_fetch(rank: int, world: int) -> list[dict]:
    """A window no longer than a chunk, under contiguous and zigzag sharding: each rank fetches only the keys in its
    window's reach (bytes counted and derived alike, at most two shards' worth); outputs and gradients exact."""
    from ds_wallfacer.attention import AttnShape, WallFacerAttention
    from ds_wallfacer.attention.documents import SequenceBatch
    from ds_wallfacer.attention.fetch import needed
    from ds_wallfacer.attention.volume import fetch_bytes
    from ds_wallfacer.comm import RankLayout, build_groups
    from ds_wallfacer.data import shard_sequence
    from tests.attention.reference import document_mask, full_inputs, reference_attention

    n, window, out = SEQ_PER_RANK * world, 5, []
    for c in [1, 2] if world % 4 == 0 else [1]:
        groups = build_groups([RankLayout(tuple(range(world)), c)])
        for sharding in ("contiguous", "zigzag"):
            q, k, v, do = full_inputs(batch=1, q_heads=4, kv_heads=2, seq_len=n, head_dim=16, dtype=torch.float32)
            want = reference_attention(q, k, v, do, causal=True, keep=document_mask([[n]], window=window))
            sh = lambda x: shard_sequence(x, dim=2, index=rank, sp_size=world, scheme=sharding)  # noqa: E731
            attn = WallFacerAttention(groups, kernel="cpu_flash", sharding=sharding)
            ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
            o = attn(ql, kl, vl, causal=True, window=window)
            o.backward(sh(do))
            errs = [(a.double() - sh(b)).abs().max().item() for a, b in zip((o, ql.grad, kl.grad, vl.grad), want)]
            shape = AttnShape(1, n, 4, 2, 16, elem_bytes=4)
            need = needed(groups.layout, sharding=sharding, causal=True, batch=SequenceBatch(), window=window,
                          local_len=SEQ_PER_RANK)
            derived = fetch_bytes(shape, need, index=rank)
            got = {ph: {kd: b for kd, b in attn.comm.by_kind(ph).items() if kd in derived[ph]} for ph in derived}
            out.append(dict(c=c, sharding=sharding, errs=errs, got=got, derived=derived,
                            shard_bytes=SEQ_PER_RANK * 2 * 32 * 4))
    return out


@pytest.mark.parametrize("world", [4, 8])
def test_sliding_window_fetches_only_its_reach(world: int) -> None:
    for rank, res in enumerate(run_distributed(_window_fetch, world, timeout_s=300)):
        for r in res:
            label = f"P={world} rank {rank} C={r['c']} {r['sharding']}"
            assert max(r["errs"]) <= 1e-5, (label, r["errs"])
            assert r["got"] == r["derived"], (label, r["got"], r["derived"])
            assert 0 < r["got"]["forward"]["fetch"] <= 2 * r["shard_bytes"] or rank in (0, world - 1), label


@pytest.mark.parametrize("causal", [True, False])
def test_window_tiles_cover_each_visible_pair_once(causal: bool) -> None:
    """Tiles no taller than the window are cut into a masked far part, an unmasked middle and a causal diagonal;
    together the tiles of a segment compute every pair inside the window exactly once, and nothing else."""
    q_chunks, k_chunks = ([1, 3], [1, 3]) if causal else ([3, 4], [1, 2])
    for window in (5, 12, 20, 40):
        seg, = segments(q_chunks, k_chunks, chunk_len=16, causal=causal, docs=BatchDocuments.single(96),
                        window=window)
        q_runs, k_runs = buffer_runs(q_chunks, 16), buffer_runs(k_chunks, 16)
        glob = lambda runs, x: next(g + x - o for o, g, n in runs if o <= x < o + n)  # noqa: E731
        got = []
        for t in window_tiles(seg, q_runs, k_runs, window=window, tile=8):
            for a in range(t.q_lo, t.q_hi):
                for b in range(t.k_lo, t.k_hi):
                    i, j = glob(q_runs, a), glob(k_runs, b)
                    if t.masked and not 0 <= i - j < window or t.causal and b > a:
                        continue
                    assert t.masked or 0 <= i - j < window, (window, t, i, j)  # unmasked: all inside the window
                    got.append((a, b))
        want = [(a, b) for a in range(seg.q_lo, seg.q_hi) for b in range(seg.k_lo, seg.k_hi)
                if 0 <= glob(q_runs, a) - glob(k_runs, b) < window]
        assert sorted(got) == want, window
