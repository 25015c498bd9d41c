"""Zigzag / contiguous sharding, global position ids and the 2P rule: pure, no processes."""
import pytest
import torch

from ds_wallfacer.attention.schedule import team_chunk_order
from ds_wallfacer.data.sharding import check_divisible, chunk_ids, position_ids, shard, unshard


@pytest.mark.parametrize("scheme", ["zigzag", "contiguous"])
@pytest.mark.parametrize("p", [1, 2, 4, 8])
def test_shard_unshard_roundtrip_and_positions(scheme, p):
    x = torch.arange(3 * 16 * p).reshape(3, 16 * p)
    shards = [shard(x, dim=1, index=i, sp_size=p, scheme=scheme) for i in range(p)]
    assert torch.equal(unshard(shards, dim=1, scheme=scheme), x)
    for i in range(p):  # position ids are the global positions of the rank's tokens
        assert torch.equal(position_ids(16 * p, index=i, sp_size=p, scheme=scheme), shards[i][0])


def test_zigzag_chunks():
    assert [chunk_ids(i, 4) for i in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(i, 2, "contiguous") for i in range(2)] == [(0, 1), (2, 3)]
    chunks, perm = team_chunk_order([2, 3], 4)
    assert chunks == [2, 3, 4, 5] and perm == [0, 2, 3, 1]


def test_length_not_divisible_by_2p_is_a_clear_error():
    with pytest.raises(ValueError, match=r"not divisible by 2 x sequence_parallel_size = 8: pad to 104 or truncate to 96"):
        check_divisible(100, 4)
    with pytest.raises(ValueError, match="not divisible"):
        shard(torch.zeros(1, 10), dim=1, index=0, sp_size=4)
