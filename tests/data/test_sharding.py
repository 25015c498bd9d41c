"""Zigzag / contiguous chunks and the 2P rule: pure, no processes (the tensors' sharding: ``test_loader.py``)."""
import pytest

from ds_wallfacer.attention.schedule import team_chunk_order
from ds_wallfacer.data.chunks import check_divisible, chunk_ids


def test_zigzag_chunks():
    assert [chunk_ids(i, 4) for i in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [chunk_ids(i, 2, "contiguous") for i in range(2)] == [(0, 1), (2, 3)]
    chunks, perm = team_chunk_order([2, 3], 4)
    assert chunks == [2, 3, 4, 5] and perm == [0, 2, 3, 1]


def test_length_not_divisible_by_2p_is_a_clear_error():
    with pytest.raises(ValueError, match=r"not divisible by 2 x sequence_parallel_size = 8: pad to 104 or truncate to 96"):
        check_divisible(100, 4)
