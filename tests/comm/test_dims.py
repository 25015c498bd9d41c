"""The vocabulary of the attention across ranks (``Mode``, ``Strategy``) and the questions ``ParallelDims`` answers
with it: pure, no processes."""
from __future__ import annotations

import json

import pytest

from ds_wallfacer.comm.dims import MODES, STRATEGIES, Mode, ParallelDims, Strategy, check_mode, ring_offset


def test_words_are_the_strings_configs_and_logs_use() -> None:
    assert MODES == ("wallfacer", "ulysses", "hybrid")
    assert STRATEGIES == ("none", "ring", "wallfacer", "ulysses", "hybrid")
    # equal to the word, formatted and dumped as the word: logs, JSON and older string comparisons keep working
    assert Mode.HYBRID == "hybrid" and f"{Mode.HYBRID}" == "hybrid" and str(Strategy.RING) == "ring"
    assert json.dumps({"mode": Mode.ULYSSES, Strategy.NONE: 1}) == '{"mode": "ulysses", "none": 1}'
    assert repr([Mode.WALLFACER, Strategy.RING]) == "['wallfacer', 'ring']"
    assert MODES.index(Mode.HYBRID) == 2  # what the setup agreement check indexes


def test_parse_refuses_other_words_naming_the_allowed_ones() -> None:
    assert Mode.parse("ulysses") is Mode.ULYSSES and Mode.parse(Mode.HYBRID) is Mode.HYBRID
    with pytest.raises(ValueError, match="wallfacer.mode = 'ring' is invalid: allowed are 'wallfacer', 'ulysses', "
                                         "'hybrid', 'auto'"):
        Mode.parse("ring")


@pytest.mark.parametrize("p,u,want", [(1, 1, Mode.WALLFACER), (8, 1, Mode.WALLFACER), (8, 8, Mode.ULYSSES),
                                      (8, 2, Mode.HYBRID), (8, 4, Mode.HYBRID), (2, 2, Mode.ULYSSES)])
def test_mode_from_sizes(p: int, u: int, want: Mode) -> None:
    assert Mode.from_sizes(p, u) is want
    assert ParallelDims(world_size=p, sp_size=p, ulysses_degree=u).mode is want


def test_mode_dimensions_and_implied_degree() -> None:
    assert [(m.has_ring, m.has_ulysses) for m in Mode] == [(True, False), (False, True), (True, True)]
    assert [m.ulysses_degree(8) for m in Mode] == [1, 8, None]


@pytest.mark.parametrize("p,u,c,want", [
    (1, 1, 1, Strategy.NONE), (4, 1, 1, Strategy.RING), (8, 1, 2, Strategy.WALLFACER), (4, 4, 1, Strategy.ULYSSES),
    (8, 2, 1, Strategy.HYBRID), (16, 2, 2, Strategy.HYBRID),
])
def test_strategy_of_sizes_and_its_mode(p: int, u: int, c: int, want: Strategy) -> None:
    assert Strategy.of(sp_size=p, ulysses_degree=u, ring_count=c) is want
    dims = ParallelDims(world_size=p, sp_size=p, ulysses_degree=u, ring_count=c)
    assert dims.strategy is want
    # a strategy runs in the mode its sizes have: ring and one rank are mode wallfacer with C = 1
    assert want.mode is dims.mode
    assert want.splits_sequence == (p > 1)


def test_which_strategies_a_fixed_mode_admits() -> None:
    admitted = {m: {s for s in Strategy if m.admits(s)} for m in Mode}
    assert admitted == {Mode.WALLFACER: {Strategy.NONE, Strategy.RING, Strategy.WALLFACER},
                        Mode.ULYSSES: {Strategy.ULYSSES}, Mode.HYBRID: {Strategy.HYBRID}}
    # the planner's fixed word: a mode word allows its strategies, "ring" and "none" only themselves
    assert Strategy.RING.allowed_by("wallfacer") and Strategy.NONE.allowed_by("wallfacer")
    assert Strategy.RING.allowed_by("ring") and not Strategy.WALLFACER.allowed_by("ring")
    assert not Strategy.NONE.allowed_by("ulysses") and Strategy.NONE.allowed_by("none")


def test_check_mode_texts_name_the_mode() -> None:
    with pytest.raises(ValueError, match='mode "wallfacer" has no Ulysses dimension'):
        check_mode(Mode.WALLFACER, ulysses_degree=2)
    with pytest.raises(ValueError, match='mode "ulysses" has no ring dimension'):
        check_mode("ulysses", ulysses_degree="auto", ring_count=2)
    with pytest.raises(ValueError, match='mode "ulysses" needs ulysses_degree = sequence_parallel_size = 8, got 2'):
        check_mode("ulysses", ulysses_degree=2, sp_size=8)
    check_mode("hybrid", ulysses_degree=2, ring_count=2, sp_size=16)


def test_dims_parse_the_word_and_compare_equal_either_way() -> None:
    a = ParallelDims(world_size=8, sp_size=8, ulysses_degree=2, mode="hybrid")
    assert a.mode is Mode.HYBRID and a == ParallelDims(world_size=8, sp_size=8, ulysses_degree=2, mode=Mode.HYBRID)
    with pytest.raises(ValueError, match="wallfacer.mode = 'both' is invalid"):
        ParallelDims(world_size=8, sp_size=8, mode="both")


@pytest.mark.parametrize("p,u,c", [(4, 1, 1), (4, 1, 2), (8, 2, 2), (16, 1, 2), (16, 1, 4), (32, 2, 2), (64, 1, 4)])
def test_sizes_read_from_dims_and_when_placement_matters(p: int, u: int, c: int) -> None:
    dims = ParallelDims(world_size=p, sp_size=p, ulysses_degree=u, ring_count=c, placement="ring-inner")
    assert (dims.ring_size, dims.group_size) == (p // u, p // u // (c * c))
    assert dims.group_size == dims.rank_layouts()[0].group_size
    # the placement matters exactly when "ring-inner" permutes the WallFacer indices
    moved = [ring_offset(i, ring_size=dims.ring_size, ring_count=c, placement="ring-inner")
             for i in range(dims.ring_size)] != list(range(dims.ring_size))
    assert dims.placement_matters == moved
