"""``wallfacer.mode``: the word is parsed to ``comm.dims.Mode``; "auto" stays the config's own word
(``fixed_mode`` None) until start-up resolves it. Pure: no processes."""
from __future__ import annotations

from dataclasses import replace

import pytest

from ds_wallfacer.comm.dims import Mode
from ds_wallfacer.config import WallFacerConfig
from ds_wallfacer.planner.auto import resolve_auto


@pytest.mark.parametrize("word", ["wallfacer", "ulysses", "hybrid"])
def test_mode_word_parsed_to_the_enum(word: str) -> None:
    cfg = WallFacerConfig.from_dict({"mode": word})
    assert cfg.mode is Mode(word) and cfg.fixed_mode is Mode(word) and cfg.mode == word
    assert replace(cfg, sequence_parallel_size=4).mode is Mode(word)


def test_auto_is_the_configs_word_until_resolved() -> None:
    cfg = WallFacerConfig.from_dict({"mode": "auto", "sequence_parallel_size": 4})
    assert cfg.mode == "auto" and cfg.fixed_mode is None
    setup = resolve_auto(cfg, world_size=4, num_heads=8, num_kv_heads=8)
    assert setup.dims.mode is Mode.WALLFACER
    assert "mode = wallfacer (the default when nothing was planned)" in setup.notes
    assert WallFacerConfig().mode is Mode.WALLFACER


def test_safe_rule_reads_the_degree_the_mode_implies() -> None:
    dims = resolve_auto(WallFacerConfig.from_dict({"mode": "ulysses"}), world_size=4, num_heads=8,
                        num_kv_heads=8).dims
    assert (dims.mode, dims.ulysses_degree, dims.ring_count) == (Mode.ULYSSES, 4, 1)
    dims = resolve_auto(WallFacerConfig.from_dict({"mode": "hybrid", "ring_count": 2}), world_size=16, num_heads=8,
                        num_kv_heads=8, ranks_per_node=4).dims
    assert (dims.mode, dims.ulysses_degree, dims.ring_count) == (Mode.HYBRID, 4, 2)
