"""The ring schedule's block calls (full, causal-diagonal, skipped) and the causal balance they give: pure."""
import pytest

from ds_wallfacer.attention.blocks import BlockCall, block_calls
from ds_wallfacer.attention.schedule import attention_work
from ds_wallfacer.comm import RankLayout


def test_block_schedule_full_diagonal_skipped():
    assert block_calls([0, 1, 6, 7], [0, 1, 6, 7], causal=True) == [BlockCall(0, 4, 0, 4, True)]
    assert block_calls([2, 3, 4, 5], [0, 1, 6, 7], causal=True) == [BlockCall(0, 4, 0, 2, False)]
    assert block_calls([0, 1, 6, 7], [2, 3, 4, 5], causal=True) == [BlockCall(2, 4, 0, 4, False)]
    assert block_calls([0, 1], [2, 3], causal=True) == []  # contiguous: a later team is skipped
    assert block_calls([0, 1], [2, 3], causal=False) == [BlockCall(0, 2, 0, 2, False)]


@pytest.mark.parametrize("p,c", [(2, 1), (4, 1), (4, 2), (8, 2), (16, 4), (64, 4), (128, 2)])
def test_zigzag_balances_causal_work(p, c):
    lay = RankLayout(tuple(range(p)), c)
    zig = attention_work(lay, sharding="zigzag", causal=True, chunk_len=64)
    con = attention_work(lay, sharding="contiguous", causal=True, chunk_len=64)
    n = 2 * p * 64
    assert sum(zig) == sum(con) == n * (n + 1) // 2  # every causal pair exactly once
    assert max(zig) / (sum(zig) / p) <= 1.05
    if p >= 4:
        assert max(con) / (sum(con) / p) > 1.7
