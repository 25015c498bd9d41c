"""Packed batches in the loader: per-document positions and labels, the document map, padding as its own
document, bad descriptions refused, balanced sharding with its chunk assignment. Pure, no processes."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.data import (
    SequenceParallelLoader,
    ShardSpec,
    prepare_batch,
    sequence_chunk_ids,
    shard_sequence,
    unshard_sequence,
    zigzag_assignment,
)

DOCS = [[5, 3, 8, 2], [1, 10, 7]]  # two rows of 18 tokens



def _want_starts(rows: list[list[int]], n: int) -> torch.Tensor:
    """The loader's ``document_starts`` of documents ``rows`` in rows of ``n`` tokens (tails filled with n)."""
    out = []
    for row in rows:
        at, starts = 0, []
        for x in row:
            starts.append(at)
            at += x
        out.append(starts)
    width = max(len(r) for r in out)
    return torch.tensor([r + [n] * (width - len(r)) for r in out])

def _positions(docs: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[k for d in row for k in range(d)] for row in docs])


def _batch(docs: list[list[int]] = DOCS) -> dict[str, torch.Tensor]:
    n = sum(docs[0])
    return {"input_ids": torch.arange(1, len(docs) * n + 1).view(len(docs), n)}


def _all_ranks(batch, p: int, **spec) -> list[dict[str, torch.Tensor]]:
    return [prepare_batch(batch, ShardSpec(index=i, sp_size=p, **spec)) for i in range(p)]


def _full(parts, key: str, **kw) -> torch.Tensor:
    return unshard_sequence([q[key] for q in parts], dim=1, **kw)


@pytest.mark.parametrize("p,u", [(2, 1), (4, 1), (4, 2), (3, 3)])
def test_packed_position_ids_give_per_document_positions_labels_and_document_map(p: int, u: int) -> None:
    batch = {**_batch(), "position_ids": _positions(DOCS)}
    parts = _all_ranks(batch, p, ulysses_degree=u)
    n = parts[0]["input_ids"].shape[1] * p  # 18 padded to a multiple of 2P
    assert torch.equal(_full(parts, "input_ids", ulysses_degree=u)[:, :18], batch["input_ids"])
    pos = _full(parts, "position_ids", ulysses_degree=u)
    want_docs = [row + [n - 18] if n > 18 else row for row in DOCS]  # the loader's padding: one more document
    assert torch.equal(pos, _positions(want_docs))
    starts = parts[0]["document_starts"]
    assert starts.dtype == torch.int64 and starts.shape == (2, max(len(r) for r in want_docs))
    assert torch.equal(starts, _want_starts(want_docs, n))
    for q in parts:  # every row's document starts, identical on every rank of the group
        assert torch.equal(q["document_starts"], starts)
    labels = _full(parts, "shift_labels", ulysses_degree=u)
    ids = batch["input_ids"]
    for b, row in enumerate(DOCS):
        start = 0
        for length in row:
            end = start + length  # inside a document: the next token; its last token: nothing
            assert labels[b, start:end - 1].tolist() == ids[b, start + 1:end].tolist()
            assert labels[b, end - 1].item() == -100
            start = end
        assert (labels[b, 18:] == -100).all()


def test_document_lengths_as_lists_or_zero_padded_tensor_equal_position_ids() -> None:
    by_pos = _all_ranks({**_batch(), "position_ids": _positions(DOCS)}, 4)
    by_list = _all_ranks({**_batch(), "document_lengths": DOCS}, 4)
    by_tensor = _all_ranks({**_batch(), "document_lengths": torch.tensor([[5, 3, 8, 2], [1, 10, 7, 0]])}, 4)
    both = _all_ranks({**_batch(), "document_lengths": DOCS, "position_ids": _positions(DOCS)}, 4)
    for other in (by_list, by_tensor, both):
        for a, b in zip(by_pos, other):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_document_per_row_still_gets_the_packed_keys_and_unpacked_batches_do_not() -> None:
    ids = torch.arange(16).view(1, 16)
    packed = prepare_batch({"input_ids": ids, "position_ids": torch.arange(16)[None]}, ShardSpec(index=0, sp_size=2))
    plain = prepare_batch({"input_ids": ids}, ShardSpec(index=0, sp_size=2))
    assert packed["document_starts"].tolist() == [[0]]
    assert "document_starts" not in plain and "chunk_assignment" not in plain
    for k in plain:  # one document from position 0 is exactly the unpacked batch
        assert torch.equal(packed[k], plain[k])


def test_right_padding_and_loader_padding_form_one_extra_document() -> None:
    ids = torch.arange(1, 15).view(1, 14)
    mask = torch.ones_like(ids)
    mask[0, 11:] = 0  # 11 real tokens: documents 6 + 5, then 3 padding + 2 of the loader's (P = 2 -> 16)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 0, 0, 0]])  # padding positions are not read
    parts = _all_ranks({"input_ids": ids, "attention_mask": mask, "position_ids": pos}, 2)
    assert parts[0]["document_starts"].tolist() == [[0, 6, 11]]
    assert _full(parts, "position_ids").tolist() == [[*range(6), *range(5), *range(5)]]
    assert _full(parts, "token_mask").tolist() == [[1] * 11 + [0] * 5]
    assert (parts[0]["sequence_length"] == 14).all()
    labels = _full(parts, "shift_labels")[0].tolist()
    assert labels[:6] == [2, 3, 4, 5, 6, -100] and labels[6:11] == [8, 9, 10, 11, -100] and set(labels[11:]) == {-100}
    # document lengths cover the real tokens only
    same = _all_ranks({"input_ids": ids, "attention_mask": mask, "document_lengths": [[6, 5]]}, 2)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(parts, same) for k in a)


def test_given_shift_labels_lose_the_targets_across_document_ends() -> None:
    ids = torch.arange(8)[None]
    shift = torch.arange(100, 108)[None]
    parts = _all_ranks({"input_ids": ids, "shift_labels": shift, "document_lengths": [[3, 5]]}, 2)
    assert _full(parts, "shift_labels").tolist() == [[100, 101, -100, 103, 104, 105, 106, -100]]


def test_bad_document_descriptions_are_refused_clearly() -> None:
    spec = ShardSpec(index=0, sp_size=2)
    ids = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"document_lengths of row 1 sum to 7, but the row has 8 tokens"):
        prepare_batch({"input_ids": ids, "document_lengths": [[4, 4], [3, 4]]}, spec)
    mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])
    with pytest.raises(ValueError, match=r"row 1 sum to 8, but the row has 6 tokens \(before right padding\)"):
        prepare_batch({"input_ids": ids, "attention_mask": mask, "document_lengths": [[8], [8]]}, spec)
    with pytest.raises(ValueError, match="has 1 rows but input_ids has 2"):
        prepare_batch({"input_ids": ids, "document_lengths": [[8]]}, spec)
    with pytest.raises(ValueError, match="non-negative integers"):
        prepare_batch({"input_ids": ids, "document_lengths": [[9, -1], [8]]}, spec)
    with pytest.raises(ValueError, match=r"position_ids of row 0 start at 1, not 0: packed position ids restart at 0"):
        prepare_batch({"input_ids": ids, "position_ids": torch.arange(1, 9).expand(2, 8)}, spec)
    bad = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 3, 4, 0, 1, 2, 3]])
    with pytest.raises(ValueError, match=r"position_ids of row 1 go from 1 to 3 at token 2: .*increase by 1"):
        prepare_batch({"input_ids": ids, "position_ids": bad}, spec)
    with pytest.raises(ValueError, match=r"row 0: document_lengths \[4, 4\] disagree .* \[3, 5\]"):
        prepare_batch({"input_ids": ids, "position_ids": _positions([[3, 5], [8]]),
                       "document_lengths": [[4, 4], [8]]}, spec)
    with pytest.raises(ValueError, match="position_ids shape"):
        prepare_batch({"input_ids": ids, "position_ids": torch.zeros(2, 7)}, spec)


def test_bidirectional_spans_travel_beside_the_documents_the_same_on_every_rank() -> None:
    """Given as lists or as a [B, S, 2] tensor padded with empty pairs, with or without packed documents: every rank
    gets the same [B, S, 2] int64 (tails filled with the empty span at the padded length), the shards unchanged."""
    ids = torch.arange(1, 29).view(2, 14)
    as_lists = {"input_ids": ids, "bidirectional_spans": [[(0, 3), (5, 9)], [(2, 12)]]}
    as_tensor = {"input_ids": ids, "bidirectional_spans": torch.tensor([[[0, 3], [5, 9]], [[2, 12], [0, 0]]])}
    for batch in (as_lists, as_tensor):
        parts = _all_ranks(batch, 2)  # padded to 16
        assert all(q["bidirectional_spans"].tolist() == [[[0, 3], [5, 9]], [[2, 12], [16, 16]]] for q in parts)
        plain = _all_ranks({"input_ids": ids}, 2)
        assert all(torch.equal(q[k], r[k]) for q, r in zip(parts, plain) for k in r)
    packed = _all_ranks({**as_lists, "document_lengths": [[4, 10], [1, 13]]}, 2)
    assert packed[1]["bidirectional_spans"].tolist() == packed[0]["bidirectional_spans"].tolist()
    assert "document_starts" in packed[0]


def test_type_runs_are_transformers_image_blocks_and_paligemma_prefixes() -> None:
    """Gemma 3: the runs of image tokens (type 1) are transformers' blocks (``get_block_sequence_ids_for_mask``); cut
    at document starts. PaliGemma: one run of prefix tokens (type 0) per document, more refused."""
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    from ds_wallfacer.data.packing import type_runs

    g = torch.Generator().manual_seed(0)
    types = (torch.rand(4, 40, generator=g) < 0.6).long()
    blocks = get_block_sequence_ids_for_mask(types)
    for r, spans in enumerate(type_runs(types, 1)):
        want = torch.full((40,), -1)
        for s, (a, b) in enumerate(spans):
            want[a:b] = s
        assert torch.equal(blocks[r], want)
    row = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 1, 0, 0]])
    assert type_runs(row, 1, starts=[[0, 2, 5]]) == [[(0, 2), (2, 3), (5, 8)]]
    assert type_runs(1 - row, 0, starts=[[0, 5]], single=True) == [[(0, 3), (5, 8)]]
    with pytest.raises(ValueError, match="row 0: the tokens of type 0 form 2 runs, some in one document"):
        type_runs(1 - row, 0, single=True)


def test_bad_bidirectional_spans_are_refused_clearly() -> None:
    spec = ShardSpec(index=0, sp_size=2)
    ids = torch.ones(2, 8, dtype=torch.long)
    bad = {"crosses a document start": ([[(2, 6)], []], [[4, 4], [8]]),
           "sorted and disjoint": ([[(2, 6), (5, 7)], []], None),
           "must lie in the row's 8 tokens": ([[(2, 9)], []], None),
           "give one list of": ([[(2, 6)]], None)}
    for message, (spans, docs) in bad.items():
        batch = {"input_ids": ids, "bidirectional_spans": spans}
        if docs:
            batch["document_lengths"] = docs
        with pytest.raises(ValueError, match=message):
            prepare_batch(batch, spec)
    mask = torch.tensor([[1] * 8, [1] * 6 + [0] * 2])  # a span into right padding
    with pytest.raises(ValueError, match="row 1: .* must lie in the row's 6 tokens"):
        prepare_batch({"input_ids": ids, "attention_mask": mask, "bidirectional_spans": [[], [(3, 8)]]}, spec)


@pytest.mark.parametrize("p,u,m", [(4, 1, 4), (4, 2, 2), (2, 1, 3), (8, 4, 4)])
def test_balanced_packed_batch_shards_by_the_assignment_and_round_trips(p: int, u: int, m: int) -> None:
    docs = [[40, 3, 17, 4], [2, 2, 60]]  # 64 tokens, padded to a multiple of P x m
    batch = {**_batch(docs), "document_lengths": docs}
    parts = _all_ranks(batch, p, ulysses_degree=u, scheme="balanced", chunks_per_rank=m)
    ring = p // u
    assign = parts[0]["chunk_assignment"]
    assert assign.dtype == torch.int64 and assign.shape == (ring, m)
    assert sorted(assign.flatten().tolist()) == list(range(ring * m))
    assert all(row == sorted(row) for row in assign.tolist())
    for q in parts:
        assert torch.equal(q["chunk_assignment"], assign) and torch.equal(q["document_starts"], parts[0]["document_starts"])
    kw = dict(ulysses_degree=u, assignment=assign.tolist())
    n = parts[0]["input_ids"].shape[1] * p
    assert n % (p * m) == 0 and parts[0]["input_ids"].shape[1] == n // p
    assert torch.equal(_full(parts, "input_ids", **kw)[:, :64], batch["input_ids"])
    want_docs = [row + [n - 64] if n > 64 else row for row in docs]
    assert torch.equal(_full(parts, "position_ids", **kw), _positions(want_docs))
    for i, q in enumerate(parts):  # each rank holds its ring rank's chunks, ascending, as pieces c*U + u
        pieces = sequence_chunk_ids(i, sp_size=p, ulysses_degree=u, assignment=assign.tolist())
        assert list(pieces) == [c * u + i % u for c in assign[i // u].tolist()]


def test_balanced_without_documents_is_zigzag_with_its_assignment() -> None:
    batch = {"input_ids": torch.arange(30)[None]}
    for i in range(4):
        bal = prepare_batch(batch, ShardSpec(index=i, sp_size=4, ulysses_degree=2, scheme="balanced"))
        zig = prepare_batch(batch, ShardSpec(index=i, sp_size=4, ulysses_degree=2))
        assert torch.equal(bal.pop("chunk_assignment"), torch.tensor(zigzag_assignment(2)))
        assert bal.keys() == zig.keys() and all(torch.equal(bal[k], zig[k]) for k in bal)


def test_balanced_refuses_an_unpadded_length_not_divisible_by_p_times_chunks() -> None:
    spec = ShardSpec(index=0, sp_size=2, scheme="balanced", chunks_per_rank=4)
    with pytest.raises(ValueError, match=r"not divisible into the assignment's 8 equal pieces.*pad to 24 or "
                                         r"truncate to 16"):
        prepare_batch({"input_ids": torch.ones(1, 20), "document_lengths": [[10, 10]]}, spec, pad=False)
    with pytest.raises(ValueError, match="chunks_per_rank = 0 is invalid"):
        ShardSpec(index=0, sp_size=2, chunks_per_rank=0)


@pytest.mark.parametrize("u", [1, 2])
def test_shard_and_unshard_with_an_explicit_assignment_round_trip(u: int) -> None:
    assignment = [(0, 5, 6), (1, 3, 8), (2, 4, 7)]  # R = 3 ring ranks x 3 chunks
    p = 3 * u
    x = torch.arange(2 * 9 * u * 4).view(2, -1)
    shards = [shard_sequence(x, dim=1, index=i, sp_size=p, ulysses_degree=u, assignment=assignment) for i in range(p)]
    assert all(s.shape[1] == x.shape[1] // p for s in shards)
    assert torch.equal(unshard_sequence(shards, dim=1, ulysses_degree=u, assignment=assignment), x)
    # the old signatures still give zigzag
    zig = [shard_sequence(x[:, :24], dim=1, index=i, sp_size=3) for i in range(3)]
    assert torch.equal(unshard_sequence(zig, dim=1), x[:, :24])
    assert torch.equal(shard_sequence(x[:, :24], dim=1, index=1, sp_size=3, assignment=zigzag_assignment(3)), zig[1])


def test_bad_assignments_are_refused() -> None:
    x = torch.arange(24)[None]
    with pytest.raises(ValueError, match="exactly once"):
        shard_sequence(x, dim=1, index=0, sp_size=2, assignment=[(0, 1), (1, 2)])
    with pytest.raises(ValueError, match="same positive number of chunks"):
        shard_sequence(x, dim=1, index=0, sp_size=2, assignment=[(0,), (1, 2)])
    with pytest.raises(ValueError, match="has 2 ring ranks but .* = 4 / 1 = 4"):
        shard_sequence(x, dim=1, index=0, sp_size=4, assignment=[(0, 3), (1, 2)])
    with pytest.raises(ValueError, match="not divisible into the assignment's 9 equal pieces"):
        shard_sequence(x, dim=1, index=0, sp_size=3, assignment=[(0, 5, 6), (1, 3, 8), (2, 4, 7)])


def test_the_loader_collates_packed_items() -> None:
    items = [
        {"input_ids": list(range(1, 11)), "position_ids": [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]},
        {"input_ids": list(range(1, 8))},  # no position ids: one document
    ]
    (b0,), (b1,) = (list(SequenceParallelLoader(items, ShardSpec(index=i, sp_size=2), batch_size=2)) for i in range(2))
    starts = b0["document_starts"]
    assert starts.tolist() == [[0, 4, 10], [0, 7, 12]] and torch.equal(b1["document_starts"], starts)
    pos = unshard_sequence([b0["position_ids"], b1["position_ids"]], dim=1)
    assert pos.tolist() == [[*range(4), *range(6), 0, 1], [*range(7), *range(5)]]
    docs = [{"input_ids": list(range(6)), "document_lengths": [2, 4]}, {"input_ids": list(range(6))}]
    (c0,) = list(SequenceParallelLoader(docs, ShardSpec(index=0, sp_size=2), batch_size=2))
    assert c0["document_starts"].tolist() == [[0, 2, 6], [0, 6, 8]]
