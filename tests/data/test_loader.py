"""The sequence-parallel data loader: layout of pieces, shifted labels, padding, position ids, replicas. Pure."""
from __future__ import annotations

import pytest
import torch

from ds_wallfacer.data import (
    SequenceParallelLoader,
    ShardSpec,
    chunk_ids,
    prepare_batch,
    sequence_chunk_ids,
    sequence_position_ids,
    shard_sequence,
    unshard_sequence,
)


@pytest.mark.parametrize("p,u,scheme", [(4, 1, "zigzag"), (8, 2, "zigzag"), (8, 4, "contiguous"), (4, 4, "zigzag"),
                                        (6, 3, "zigzag"), (1, 1, "zigzag")])
def test_pieces_cover_the_sequence_and_gather_into_ring_chunks(p: int, u: int, scheme: str) -> None:
    pieces = [sequence_chunk_ids(i, sp_size=p, ulysses_degree=u, scheme=scheme) for i in range(p)]
    assert sorted(c for pc in pieces for c in pc) == list(range(2 * p))
    r_count = p // u
    for r in range(r_count):
        # after the Ulysses all-to-all, [U, 2] pieces -> [2, U]: ring rank r's two chunks of 2R, in order
        gathered = [pieces[r * u + j][k] for k in range(2) for j in range(u)]
        a, b = chunk_ids(r, r_count, scheme)
        assert gathered == [a * u + j for j in range(u)] + [b * u + j for j in range(u)]
    if u == 1:
        assert pieces == [chunk_ids(i, p, scheme) for i in range(p)]


def test_shard_unshard_roundtrip_and_positions() -> None:
    x = torch.arange(2 * 48).view(2, 48)
    shards = [shard_sequence(x, dim=1, index=i, sp_size=4, ulysses_degree=2) for i in range(4)]
    assert torch.equal(unshard_sequence(shards, dim=1, ulysses_degree=2), x)
    assert torch.equal(sequence_position_ids(48, index=1, sp_size=4, ulysses_degree=2), shards[1][0])


def test_labels_are_shifted_before_sharding_and_padding_is_ignored() -> None:
    ids = torch.arange(1, 15).view(1, 14)  # 14 tokens, P = 2 -> padded to 16
    mask = torch.ones_like(ids)
    mask[0, 12:] = 0
    parts = [prepare_batch({"input_ids": ids, "attention_mask": mask}, ShardSpec(index=i, sp_size=2), pad_token_id=0)
             for i in range(2)]
    full = {k: unshard_sequence([p[k] for p in parts], dim=1) for k in parts[0]}
    assert torch.equal(full["input_ids"][0], torch.tensor([*range(1, 15), 0, 0]))
    assert torch.equal(full["position_ids"][0], torch.arange(16))
    # position i predicts token i + 1; tokens 12.. are padding; the label of the last real token is gone
    want = [*range(2, 13), -100, -100, -100, -100, -100]
    assert full["shift_labels"][0].tolist() == want
    # labels cross shard boundaries correctly: rank 0 holds chunks 0 and 3, its first chunk's last label is token 5
    assert parts[0]["shift_labels"][0, 3].item() == 5


def test_loader_errors() -> None:
    spec = ShardSpec(index=0, sp_size=4)
    with pytest.raises(ValueError, match=r"not divisible by 2 x sequence_parallel_size = 8: pad to 32 or truncate to 24"):
        prepare_batch({"input_ids": torch.zeros(1, 30, dtype=torch.long)}, spec, pad=False)
    with pytest.raises(ValueError, match="left padding and holes are not supported"):
        prepare_batch({"input_ids": torch.ones(1, 8), "attention_mask": torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1]])}, spec)
    with pytest.raises(ValueError, match="labels shape"):
        prepare_batch({"input_ids": torch.ones(1, 8), "labels": torch.ones(1, 7)}, spec)
    with pytest.raises(ValueError, match=r"\(images or videos\) are not supported here"):
        prepare_batch({"input_ids": torch.ones(1, 8), "pixel_values": torch.ones(1)}, spec)
    with pytest.raises(ValueError, match="not supported by the sequence-parallel loader"):
        prepare_batch({"input_ids": torch.ones(1, 8), "token_type_ids": torch.ones(1, 8)}, spec)
    with pytest.raises(ValueError, match="needs 'input_ids'"):
        prepare_batch({"labels": torch.ones(1, 8)}, spec)


def test_replicas_get_disjoint_data_and_sp_ranks_the_same() -> None:
    data = [torch.full((10 + i,), i) for i in range(8)]  # map-style, variable lengths (right-padded per batch)
    seen = {}
    for d in range(2):
        for i in range(2):
            loader = SequenceParallelLoader(data, ShardSpec(index=i, sp_size=2, dp_rank=d, dp_size=2), batch_size=2,
                                            shuffle=True, seed=3)
            assert len(loader) == 2
            seen[(d, i)] = list(loader)
    items = {d: [int(b["input_ids"][r, 0]) for b in seen[(d, 0)] for r in range(2)] for d in range(2)}
    assert set(items[0]).isdisjoint(items[1]) and set(items[0]) | set(items[1]) == set(range(8))
    for d in range(2):  # the two SP ranks of a replica hold the two halves of the same padded batches
        for b0, b1 in zip(seen[(d, 0)], seen[(d, 1)]):
            full = unshard_sequence([b0["input_ids"], b1["input_ids"]], dim=1)
            assert full.shape[1] % 4 == 0
            for row in range(2):
                n = 10 + int(full[row, 0])
                assert (full[row, :n] == full[row, 0]).all() and (full[row, n:] == 0).all()
    # an iterable of batches: replica d takes batches d, d + D, ...
    batches = [{"input_ids": torch.full((1, 8), k)} for k in range(5)]
    loader = SequenceParallelLoader(batches, ShardSpec(index=0, sp_size=2, dp_rank=1, dp_size=2))
    assert [int(b["input_ids"][0, 0]) for b in loader] == [1, 3] and len(loader) == 2


def test_collate_refuses_a_per_token_key_it_would_drop() -> None:
    """An item key of one value per token that the collate does not keep (PaliGemma's token_type_ids where no
    adapter reads them, as under dynamic sequence parallelism) is refused; a dataset's text column is left behind."""
    from ds_wallfacer.data.loader import collate_right_padded

    assert collate_right_padded([{"input_ids": [1, 2, 3], "text": "abc"}])["input_ids"].tolist() == [[1, 2, 3]]
    with pytest.raises(ValueError, match="'token_type_ids' holds one value per token"):
        collate_right_padded([{"input_ids": [1, 2, 3], "token_type_ids": [0, 0, 1]}])
    kept = collate_right_padded([{"input_ids": [1, 2, 3], "token_type_ids": [0, 0, 1]}], token_keys=("token_type_ids",))
    assert kept["token_type_ids"].tolist() == [[0, 0, 1]]
