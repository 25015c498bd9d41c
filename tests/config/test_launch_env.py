"""``ranks_per_node: "auto"`` reads the launch environment: torchrun's LOCAL_WORLD_SIZE or the deepspeed launcher's
LOCAL_SIZE (it sets no LOCAL_WORLD_SIZE), so teams and Ulysses groups stay inside a node under either. Pure."""
from __future__ import annotations

import pytest

from ds_wallfacer.config import WallFacerConfig
from ds_wallfacer.planner.auto import resolve_auto


@pytest.mark.parametrize("var", ["LOCAL_WORLD_SIZE", "LOCAL_SIZE"])
def test_ranks_per_node_from_either_launcher(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(var, "2")
    lay = resolve_auto(WallFacerConfig(mode="hybrid"), world_size=8, num_heads=8, num_kv_heads=8)
    assert lay.ranks_per_node == 2
    assert lay.dims.ulysses_degree == 2 and "the 2 ranks of a node" in " ".join(lay.notes), lay.notes
    assert all(len({r // 2 for r in lay.dims.ulysses_ranks(0, i)}) == 1 for i in range(lay.dims.ring_size))
