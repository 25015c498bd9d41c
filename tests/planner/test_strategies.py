"""The planner speaks the one vocabulary of ``comm.dims``: a candidate's strategy and sizes come from its
``ParallelDims``, a fixed mode admits the strategies ``Mode.admits`` says, the choice names its ``Mode``."""
from __future__ import annotations

import pytest

from ds_wallfacer.comm.dims import Mode, Strategy
from ds_wallfacer.planner import Candidate, Workload, enumerate_candidates, get_cluster, get_model, resolve


def test_candidate_reads_sizes_from_its_dims() -> None:
    c = Candidate(sp_size=32, ulysses_degree=2, ring_count=2, placement="ring-inner")
    assert c.dims.sp_size == c.dims.world_size == 32 and c.dims.mode is Mode.HYBRID
    assert (c.strategy, c.ring_size, c.group_size) == (Strategy.HYBRID, 16, 4)
    assert "[ring-inner]" in c.label and c == Candidate(sp_size=32, ulysses_degree=2, ring_count=2,
                                                        placement="ring-inner")
    # G = 1: "ring-inner" is the identity order, so the label does not name it
    assert "[ring-inner]" not in Candidate(sp_size=4, ring_count=2, placement="ring-inner").label
    with pytest.raises(ValueError, match="C\\*C must divide 4"):
        Candidate(sp_size=8, ulysses_degree=2, ring_count=4)


@pytest.mark.parametrize("fixed,want", [
    ("wallfacer", {Strategy.NONE, Strategy.RING, Strategy.WALLFACER}), ("ring", {Strategy.RING}),
    ("ulysses", {Strategy.ULYSSES}), ("hybrid", {Strategy.HYBRID}), (Mode.HYBRID, {Strategy.HYBRID}),
])
def test_fixed_mode_admits_its_strategies(fixed: str, want: set[Strategy]) -> None:
    cands, _ = enumerate_candidates(get_model("llama3-8b"), get_cluster("h100x64").with_world_size(16),
                                    Workload(65536), {"mode": fixed, "mini_sequence": True,
                                                      "activation_checkpointing": True})
    assert {c.strategy for c in cands} == want


def test_choice_names_its_mode() -> None:
    c = resolve("h100x64", "llama3-8b", 131072, 64, {"sp_size": 64, "mode": "ring"})
    assert c.strategy is Strategy.RING and c.mode is Mode.WALLFACER and c.as_dict()["mode"] == "wallfacer"
