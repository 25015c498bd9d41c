"""Bidirectional spans in the block schedule (``attention/spans.py``, ``blocks.kernel_calls``), as pure integer math:
every kernel call of every rank, read pair by pair, computes each visible (query, key) pair of HF's Gemma 3 mask
exactly once and nothing else, in the direct fetch (any P and sharding), the ring and teams (C = 1, 2) and the
local attention of Ulysses; a block above the causal diagonal is computed only where a span crosses it; each rank
fetches exactly the keys its queries see (``volume.needed_positions`` with spans). Outputs and gradients of every
mode against the single-process reference are ``test_documents.py``'s, the counted bytes ``test_fetch.py``'s.
"""
from __future__ import annotations

from collections import Counter

import pytest

from ds_wallfacer.attention.blocks import BlockCall, buffer_runs, kernel_calls
from ds_wallfacer.attention.documents import BatchDocuments, SequenceBatch
from ds_wallfacer.attention.fetch import FetchSchedule, needed
from ds_wallfacer.attention.schedule import RingSchedule
from ds_wallfacer.attention.spans import full_layers, span_pieces, upper_runs
from ds_wallfacer.comm.layout import RankLayout
from ds_wallfacer.data.chunks import rank_chunks


def test_span_pieces_upper_runs_and_full_layers() -> None:
    # buffer of chunks 1 and 6 (length 8): global [8, 16) then [48, 56); a span across both is one buffer range
    runs = buffer_runs([1, 6], 8)
    assert span_pieces(runs, [(0, 3), (10, 50), (55, 60)]) == [(1, 2, 10), (2, 15, 16)]
    assert span_pieces(runs, [(16, 48)]) == []
    # query chunks 1, 2, 6 against keys 0, 3, 4, 7: keys after chunks 1-2 are 3, 4, 7; after 6 only 7
    assert upper_runs([1, 2, 6], [0, 3, 4, 7]) == [(0, 2, 1, 4), (2, 3, 3, 4)]
    assert upper_runs([5], [0, 1]) == []
    # a span row's keys below its chunk and its span's keys above it touch: one span; the rows outside keep theirs
    assert full_layers([(0, 16, 0, 8), (4, 16, 8, 12)]) == [[(0, 4, 0, 8), (4, 16, 0, 12)]]
    assert full_layers([(0, 4, 0, 8), (8, 9, 3, 5)]) == [[(0, 4, 0, 8), (8, 9, 3, 5)]]  # disjoint: as given
    assert full_layers([(0, 4, 0, 2), (0, 4, 5, 6)]) == [[(0, 4, 0, 2)], [(0, 4, 5, 6)]]  # no touch: two calls
    with pytest.raises(ValueError, match="twice"):
        full_layers([(0, 4, 0, 3), (2, 4, 2, 5)])


def test_spans_are_checked() -> None:
    with pytest.raises(ValueError, match="crosses a document start"):
        BatchDocuments(starts=((0, 10),), seq_len=32, spans=(((8, 12),),))
    with pytest.raises(ValueError, match="sorted and disjoint"):
        BatchDocuments(starts=((0,),), seq_len=32, spans=(((4, 9), (8, 12)),))
    with pytest.raises(ValueError, match="one \\(possibly empty\\) list of spans per row"):
        BatchDocuments(starts=((0,), (0,)), seq_len=32, spans=(((4, 9),),))
    docs = BatchDocuments(starts=((0,), (0,)), seq_len=32, spans=(((3, 4),), ()))
    assert not docs.has_spans  # a one-token span is its causal row


def _visible(docs: BatchDocuments, window: int | None) -> Counter:
    """Every (row, query, key) pair HF's Gemma 3 mask keeps: one document, i - j < window, and j <= i or one span."""
    n, out = docs.seq_len, Counter()
    for r, starts in enumerate(docs.starts):
        doc = [sum(1 for s in starts if s <= t) for t in range(n)]
        span = [-1] * n
        for s, (a, b) in enumerate(docs.spans[r] if docs.spans else ()):
            span[a:b] = [s] * (b - a)
        for i in range(n):
            for j in range(n):
                if doc[i] == doc[j] and (window is None or i - j < window) and (j <= i or span[i] == span[j] >= 0):
                    out[(r, i, j)] += 1
    return out


def _pairs(call, q_glob: list[int], k_glob: list[int], rows: int, window: int | None) -> Counter:
    """The (row, global query, global key) pairs one kernel call computes, read from its ranges, its varlen spans
    (descending with ``reverse``), causal alignment and window mask; ``q_glob`` / ``k_glob``: its buffers' globals."""
    q0, k0, out = call.qs.start, call.ks.start, Counter()
    spans = call.spans or ((0, call.qs.stop - q0, 0, call.ks.stop - k0),)
    for a, b, c, d in spans:
        for x in range(q0 + a, q0 + b):
            for y in range(k0 + c, k0 + d):
                if call.reverse and (k0 + d - 1 - y) > (q0 + b - 1 - x):
                    continue
                if call.causal and not call.reverse and y - (k0 + c) > x - (q0 + a):
                    continue
                gi, gj = q_glob[x], k_glob[y]
                if call.mask is not None and not 0 <= gi - gj < window:
                    continue
                for r in range(*call.rows.indices(rows)):
                    out[(r, gi, gj)] += 1
    return out


def _globals(chunks, chunk_len: int) -> list[int]:
    return [g0 + t for _, g0, n in buffer_runs(list(chunks), chunk_len) for t in range(n)]


def _cases(n: int):
    """(documents, window): one document with spans at 0, across chunks and across ranks; packed documents with
    spans longer than the window; two rows with different spans."""
    one = BatchDocuments(starts=((0,),), seq_len=n, spans=(((0, 5), (9, n // 2 + 3), (n - 6, n - 1)),))
    packed = BatchDocuments(starts=((0, n // 3),), seq_len=n, spans=(((2, n // 3 - 1), (n // 3 + 5, n - 2)),))
    rows = BatchDocuments(starts=((0,), (0, n // 2)), seq_len=n,
                          spans=(((n // 4, 3 * n // 4),), ((1, 4), (n // 2, n // 2 + 9))))
    return [(one, None), (one, 5), (packed, None), (packed, 6), (rows, 7)]


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_fetch_calls_compute_each_visible_pair_once(p: int, sharding: str) -> None:
    n, local = 16 * p, 16
    lay = RankLayout(tuple(range(p)), 1)
    held = rank_chunks(p, sharding)
    for docs, window in _cases(n):
        batch, rows = SequenceBatch(documents=docs), len(docs.starts)
        got, need = Counter(), needed(lay, sharding=sharding, causal=True, batch=batch, window=window,
                                      local_len=local)
        for i in range(p):
            plan = FetchSchedule.plan(lay, i, sharding=sharding, causal=True, batch=batch, window=window, rows=rows,
                                      local_len=local)
            mine = _globals(held[i], local // 2)
            for call in plan.own:
                got += _pairs(call, mine, mine, rows, window)
            fetched = [0] * p
            for src in plan.sources.values():
                theirs = _globals(held[src.index], local // 2)
                keys = [theirs[t] for a, b in src.ranges for t in range(a, b)]
                for call in src.calls:
                    got += _pairs(call, mine, keys, rows, window)
                fetched[src.index] = src.size
            assert fetched == need[i], (docs, window, i, fetched, need[i])  # exactly what its queries see
        assert got == _visible(docs, window), (p, sharding, docs, window)


@pytest.mark.parametrize("p, c", [(4, 1), (4, 2), (8, 2)])
def test_ring_and_team_calls_compute_each_visible_pair_once(p: int, c: int) -> None:
    """Every member pair of every ring step (C = 2, P = 8: two ring steps of teams of two)."""
    local = 16
    lay = RankLayout(tuple(range(p)), c)
    held = rank_chunks(p, "zigzag")
    for docs, window in _cases(16 * p):
        batch, rows, got = SequenceBatch(documents=docs), len(docs.starts), Counter()
        for i in range(p):
            plan = RingSchedule.plan(lay, i, sharding="zigzag", causal=True, batch=batch, window=window, rows=rows,
                                     local_len=local)
            place, g = lay.places[i], lay.group_size
            kv_group = (place.group + place.local) % c
            for s, step in enumerate(plan.steps):
                kv_team = kv_group * g + (place.pos - s) % g
                for call in step:
                    q = _globals(held[place.team * c + call.qm], local // 2)
                    k = _globals(held[kv_team * c + call.km], local // 2)
                    got += _pairs(call, q, k, rows, window)
        assert got == _visible(docs, window), (p, c, docs, window)


def test_local_calls_compute_each_visible_pair_once() -> None:
    from ds_wallfacer.attention.local import local_calls

    n = 48
    for docs, window in _cases(n):
        rows = len(docs.starts)
        got = Counter()
        for call in local_calls(rows, n, True, SequenceBatch(documents=docs), window):
            got += _pairs(call, list(range(n)), list(range(n)), rows, window)
        assert got == _visible(docs, window), (docs, window)


def test_blocks_above_the_diagonal_run_only_where_a_span_crosses_them() -> None:
    """Zigzag, P = 4, chunks of 16: rank 1 holds chunks 1 and 6. A span inside chunk 1 adds one call on its own
    diagonal (the strictly upper triangle) and nothing above it: the same fetches as the causal row. A span from
    chunk 6 into chunk 7 (rank 0's) adds the 8 keys of chunk 7 it covers, merged into the call rank 1 already makes
    on rank 0's block (chunk 0): one call per fetched block still, and no other key fetched beyond the causal row's
    (chunk 6 sees every earlier key anyway)."""
    lay, n = RankLayout(tuple(range(4)), 1), 128
    plan = lambda spans: FetchSchedule.plan(lay, 1, sharding="zigzag", causal=True, rows=1, window=None,  # noqa: E731
                                            local_len=32, batch=SequenceBatch(documents=BatchDocuments(
                                                starts=((0,),), seq_len=n, spans=(spans,))))
    causal, inside, across = plan(()), plan(((18, 30),)), plan(((100, 120),))
    assert len(causal.own) == 1 and len(inside.own) == 2 and inside.own[1].reverse
    assert inside.sources == causal.sources and inside.sends == causal.sends
    assert len(across.own) == 2
    for s, src in across.sources.items():
        assert len(src.calls) == 1  # merged into the block's one call
        extra = src.size - causal.sources[s].size
        assert extra == (120 - 112 if src.index == 0 else 0), (s, src.index, extra)
    # a disjoint pair with no span crossing it: no call at all (rank 0's chunks 0, 7 against rank 1's 1, 6)
    calls = kernel_calls([0, 7], [1, 6], [BlockCall(1, 2, 0, 2, False)], chunk_len=16, rows=1, window=None,
                         docs=BatchDocuments(starts=((0,),), seq_len=n, spans=(((70, 90),),)))
    assert [(c.qs, c.ks, c.spans) for c in calls] == [(slice(16, 32), slice(0, 32), None)]


def _triangles(lengths: list[int]) -> tuple[int, tuple]:
    """Pieces of the given lengths end to end; each one's strictly upper triangle as a reverse varlen span."""
    spans, at = [], 0
    for x in lengths:
        spans.append((at, at + x - 1, at + 1, at + x))
        at += x
    return at, tuple(spans)


@pytest.mark.parametrize("kernel", ["cpu_flash", "reference"])
def test_reverse_varlen_call_is_each_spans_strictly_upper_triangle(kernel: str) -> None:
    """A ``reverse`` varlen call (pieces of 2 to 600 tokens: short ones batched by length class, the last its own
    class) gives each query exactly the softmax over the keys after it in its piece, and their gradients, against the
    float64 reference with that mask written out."""
    import torch

    from ds_wallfacer.attention.blocks import KernelCall
    from ds_wallfacer.attention.calls import call_backward, call_forward
    from ds_wallfacer.attention.kernels import get_kernel
    from tests.attention.reference import reference_attention

    n, spans = _triangles([2, 5, 17, 40, 600])
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(2, 4, n, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 2, n, 16, generator=g) for _ in range(2))
    kern = get_kernel(kernel, q)
    call = KernelCall(slice(0, 2), slice(0, n), slice(0, n), True, None, 0, spans=spans, reverse=True)
    out, lse = call_forward(kern, call, q, k, v, scale=0.25, window=None, softcap=0.0)
    dq, dk, dv = call_backward(kern, call, False, do, q, k, v, out, lse, scale=0.25, window=None, softcap=0.0)
    for a, b, c, d in spans:
        keep = torch.ones(b - a, d - c, dtype=torch.bool).triu()  # key c + j after query a + i iff j >= i
        want = reference_attention(q[:, :, a:b], k[:, :, c:d], v[:, :, c:d], do[:, :, a:b], causal=False, scale=0.25,
                                   keep=keep)
        for x, y in ((out[:, :, a:b], want[0]), (dq[:, :, a:b], want[1]), (dk[:, :, c:d], want[2]),
                     (dv[:, :, c:d], want[3])):
            assert (x.double() - y).abs().max().item() <= 2e-5, (kernel, a, b)
    last = [b for _, b, _, _ in spans]  # a piece's last token sees no key after it; its first key is no query's
    assert torch.isinf(lse[:, :, last]).all() and not dk[:, :, [a for a, _, _, _ in spans]].any()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kernel", ["cuda_sdpa", "flash_attn", "cudnn", "flash_attn3", "flash_attn4"])
def test_cuda_reverse_varlen_call_equals_flipped_causal_calls(kernel: str) -> None:
    """On the GPU backends (each skips where it does not run): a ``reverse`` varlen call equals one ordinary causal
    call per piece on the piece's queries and keys flipped, in bf16."""
    import torch

    from ds_wallfacer.attention.blocks import KernelCall
    from ds_wallfacer.attention.calls import call_backward, call_forward, expand_grads
    from ds_wallfacer.attention.kernels import KERNELS

    n, spans = _triangles([2, 70, 129, 300, 33])
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(1, 8, n, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, 2, n, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    kern = KERNELS[kernel]()
    if not kern.supports(q):
        pytest.skip(f"{kernel} does not run here")
    scale = 128**-0.5
    call = KernelCall(slice(0, 1), slice(0, n), slice(0, n), True, None, 0, spans=spans, reverse=True)
    out, lse = call_forward(kern, call, q, k, v, scale=scale, window=None, softcap=0.0)
    expand = expand_grads(kern, q, k)
    dq, dk, dv = call_backward(kern, call, expand, do, q, k, v, out, lse, scale=scale, window=None, softcap=0.0)
    for a, b, c, d in spans:
        f = lambda x, lo, hi: x[:, :, lo:hi].flip(2).contiguous()  # noqa: E731
        one = KernelCall(slice(0, 1), slice(0, b - a), slice(0, d - c), True, None, 0)
        o1, l1 = call_forward(kern, one, f(q, a, b), f(k, c, d), f(v, c, d), scale=scale, window=None, softcap=0.0)
        g1 = call_backward(kern, one, expand, f(do, a, b), f(q, a, b), f(k, c, d), f(v, c, d), o1, l1, scale=scale,
                           window=None, softcap=0.0)
        torch.testing.assert_close(out[:, :, a:b].float(), o1.flip(2).float(), atol=2e-2, rtol=0)
        torch.testing.assert_close(dq[:, :, a:b].float(), g1[0].flip(2).float(), atol=5e-2, rtol=0)
        torch.testing.assert_close(dk[:, :, c:d].float(), g1[1].flip(2).float(), atol=1e-1, rtol=2e-2)
        torch.testing.assert_close(dv[:, :, c:d].float(), g1[2].flip(2).float(), atol=1e-1, rtol=2e-2)


def test_the_reference_mask_is_hf_gemma3s_and_paligemma2s_where_spans_fit_the_window() -> None:
    """``reference.span_mask`` (the tests' ground truth) equals the masks transformers builds for Gemma 3's image
    tokens (``create_masks_for_vision_model``: full layers OR(causal, blockwise), sliding layers AND(window,
    OR(causal, blockwise))), spans longer than the window included. PaliGemma 2's sliding layers OR the blockwise
    overlay onto the sliding causal mask instead, which differs only where a span is longer than the window."""
    import torch
    from transformers import Gemma3TextConfig
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model, \
        get_block_sequence_ids_for_mask

    from tests.attention.reference import span_mask

    n, window = 24, 5
    cfg = Gemma3TextConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           num_hidden_layers=2, intermediate_size=64, vocab_size=300, sliding_window=window,
                           layer_types=["sliding_attention", "full_attention"])
    cfg._attn_implementation = "sdpa"  # boolean masks
    spans = [[(0, 4), (6, 15)], [(3, 20)], [(2, 6), (9, 12)]]
    types = torch.zeros(len(spans), n, dtype=torch.long)  # Gemma 3's token_type_ids: 1 on image tokens
    for r, row in enumerate(spans):
        for a, b in row:
            types[r, a:b] = 1
    embeds, positions = torch.zeros(len(spans), n, 32), torch.arange(n).expand(len(spans), -1)
    hf = create_masks_for_vision_model(cfg, embeds, None, None, positions, get_block_sequence_ids_for_mask(types))
    docs = [[n]] * len(spans)
    assert torch.equal(hf["full_attention"], span_mask(docs, spans))
    assert torch.equal(hf["sliding_attention"], span_mask(docs, spans, window=window))
    groups = torch.full((len(spans), n), -1)  # PaliGemma's prefix is one group: here each span is one
    for r, row in enumerate(spans):
        for s, (a, b) in enumerate(row):
            groups[r, a:b] = s
    pali = create_sliding_window_causal_mask(cfg, embeds, None, None, positions, block_sequence_ids=groups)
    fits = span_mask(docs, spans, window=window)[2]  # the last row's spans are no longer than the window
    assert torch.equal(pali[2], fits) and not torch.equal(pali[:2], span_mask(docs[:2], spans[:2], window=window))
