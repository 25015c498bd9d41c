"""The communication config generator: pure layout math, no processes."""
import itertools

import pytest

from ds_wallfacer.comm import RankLayout, valid_ring_counts


@pytest.mark.parametrize("p,c", [(1, 1), (4, 1), (4, 2), (8, 2), (16, 4), (16, 2), (64, 4), (32, 2)])
def test_every_query_team_meets_every_key_team_exactly_once(p, c):
    lay = RankLayout(tuple(range(p)), c)
    g = lay.group_size
    seen = set()
    for place in lay.places:
        for s in range(g):  # k/v team held at ring step s (the schedule of schedule.ring_schedule)
            kv_team = ((place.group + place.local) % c) * g + (place.pos - s) % g
            pair = (place.team, kv_team)
            assert pair not in seen, f"pair {pair} computed twice"
            seen.add(pair)
    assert seen == set(itertools.product(range(p // c), repeat=2))


@pytest.mark.parametrize("p,c", [(4, 2), (8, 2), (16, 4), (16, 1)])
def test_neighbours_skew_and_home_are_permutations(p, c):
    lay = RankLayout(tuple(range(10, 10 + p)), c)  # global ranks need not start at 0
    assert sorted(x.ring_next for x in lay.places) == list(lay.ranks)
    for x in lay.places:  # what x sends to y, y expects from x
        assert lay.place_of_rank(x.ring_next).ring_prev == x.rank
        for m, y in enumerate(x.kv_sources):
            py = lay.place_of_rank(y)
            assert py.local == m and py.team == x.kv_team and py.kv_dests[x.local] == x.rank
        for m, y in enumerate(x.home_dests):
            py = lay.place_of_rank(y)
            assert py.local == m and py.home_sources[x.local] == x.rank
        assert len({lay.place_of_rank(r).team for r in x.team_ranks}) == 1
        nxt = lay.place_of_rank(x.ring_next)
        assert (nxt.group, nxt.local) == (x.group, x.local)  # the sub-ring stays in its group and lane
        assert (x.kv_dests[0] == x.rank) == (x.local == 0)


def test_c1_is_plain_ring():
    lay = RankLayout(tuple(range(8)), 1)
    assert lay.group_size == 8 and lay.num_teams == 8
    assert [p.ring_next for p in lay.places] == [1, 2, 3, 4, 5, 6, 7, 0]
    assert all(p.kv_sources == p.kv_dests == (p.rank,) for p in lay.places)


def test_teams_are_consecutive_and_placement_report():
    lay = RankLayout(tuple(range(16)), 2, ranks_per_node=8)
    assert lay.teams()[:2] == [(0, 1), (2, 3)] and not lay.teams_cross_nodes()
    assert "R=16 C=2 G=4" in lay.describe()
    assert RankLayout(tuple(range(9)), 3, ranks_per_node=4).teams_cross_nodes()


@pytest.mark.parametrize("p,c", [(8, 4), (6, 2), (4, 0), (4, -1), (12, 3)])
def test_invalid_ring_count_names_valid_choices(p, c):
    with pytest.raises(ValueError, match=rf"C\*C must divide {p}\. Valid ring counts: \[1"):
        RankLayout(tuple(range(p)), c)


def test_bad_groups():
    with pytest.raises(ValueError, match="duplicates"):
        RankLayout((0, 1, 1, 2), 1)
    with pytest.raises(ValueError, match="empty"):
        RankLayout((), 1)
    with pytest.raises(ValueError, match="not in this ring group"):
        RankLayout((0, 1), 1).place_of_rank(5)
    assert valid_ring_counts(16) == [1, 2, 4] and valid_ring_counts(8) == [1, 2]
