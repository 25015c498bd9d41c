"""The planner: enumeration, memory rejections, fixed values, impossible requests, the CLI (in-process)."""
import json

import pytest

from ds_wallfacer.planner import cli
from ds_wallfacer.planner import PlanError, enumerate_candidates, get_cluster, get_model, plan, resolve, Workload


def test_plan_ranks_and_rejects():
    pl = plan("h100x64", "llama3-8b", 131072)
    fits = [r for r in pl.rows if r.fits]
    assert fits and all(not r.fits for r in pl.rows[len(fits):])
    assert [r.cost.tokens_per_s for r in fits] == sorted((r.cost.tokens_per_s for r in fits), reverse=True)
    assert all(r.reason.startswith("out of memory") for r in pl.rows[len(fits):])
    assert pl.choice.candidate == fits[0].candidate and pl.choice.reasons
    assert "Ulysses U=64: does not divide 32 query heads" in pl.skipped
    json.dumps(pl.as_dict(), default=str)


def test_resolve_respects_fixed_values():
    c = resolve("h100x64", "llama3-8b", 131072, 64, {"sp_size": 64, "ring_count": "auto", "mode": "wallfacer"})
    assert c.sp_size == 64 and c.ulysses_degree == 1 and c.mode == "wallfacer" and c.dp_size == 1
    c = resolve("h100x64", "llama3-8b", 131072, 64, {"mode": "hybrid", "ulysses_degree": 4, "mini_sequence": True})
    assert (c.strategy, c.ulysses_degree, c.mini_sequence) == ("hybrid", 4, True) and c.mlp_chunk_tokens == 1024
    c = resolve("h100x64", "llama3-8b", 131072, 16, {"sp_size": 16, "placement": "team-inner"})
    assert c.placement == "team-inner" and c.sp_size == 16
    one = resolve("h200x1", "llama3-8b", 65536, workload=Workload(65536, offload_optimizer=True))
    assert one.strategy == "none" and one.sp_size == 1
    with pytest.raises(PlanError, match="offloading"):  # 8B with Adam on one GPU: 16 bytes per parameter
        resolve("h200x1", "llama3-8b", 16384)
    with pytest.raises(ValueError, match="unknown fixed key"):
        resolve("h100x64", "llama3-8b", 131072, 64, {"rings": 2})


def test_head_caps_and_kv_replication():
    m = get_model("llama3-8b")  # 32 heads, 8 kv heads
    cl = get_cluster("h100x64")
    us = {c.ulysses_degree for c in enumerate_candidates(m, cl, Workload(131072), {"sp_size": 64})[0]}
    assert us == {1, 2, 4, 8, 16, 32}
    capped = Workload(131072, kv_replication=False)
    assert max(c.ulysses_degree for c in enumerate_candidates(m, cl, capped, {"sp_size": 64})[0]) == 8


def test_impossible_requests_name_nearest_settings():
    with pytest.raises(PlanError) as e:
        plan("h100x64", "llama3-8b", 131072, fixed={"ring_count": 3})
    assert "feasible ring_count values" in str(e.value) and e.value.suggestions
    with pytest.raises(PlanError, match=r"feasible sp_size values: \[.*16.*\]"):
        plan("h100x64", "llama3-8b", 131072, world_size=48, fixed={"sp_size": 20})
    with pytest.raises(PlanError, match="seq_len must be a multiple"):
        plan("h100x64", "llama3-8b", 131000, fixed={"sp_size": 64})
    with pytest.raises(PlanError, match="nothing fits") as e:
        plan("h100x64", "llama3-8b", 4 * 2**20, world_size=8)
    text = str(e.value)
    assert "seq_len <=" in text and "ranks (" in text


@pytest.mark.parametrize("world,seq", [(8, 32768), (1024, 4 * 2**20)])
def test_scale_enumeration_completes(world, seq):
    pl = plan("h100x64", "llama3-8b", seq, world_size=world)
    assert len(pl.rows) > 40 and any(r.fits for r in pl.rows)


def test_cli_json_and_table(capsys, tmp_path):
    assert cli.main(["--cluster", "h100x64", "--model", "llama3-8b", "--seq-len", "131072", "--json", "--plot", "none"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["choice"]["sp_size"] >= 1 and out["rows"][0]["fits"]
    assert cli.main(["--cluster", "a100x32-eth", "--model", "qwen2-7b", "--seq-len", "65536", "--sp-size", "32",
                     "--plot", str(tmp_path / "p.png"), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "choice:" in text and "best of each strategy" in text and (tmp_path / "p.png").stat().st_size > 0
    assert cli.main(["--cluster", "h100x64", "--seq-len", "131072", "--ring-count", "3", "--plot", "none"]) == 2
    assert "feasible ring_count" in capsys.readouterr().err
    assert cli.main(["--paper"]) == 0
    assert "1.625" in capsys.readouterr().out


def test_multi_ring_only_where_it_pays():
    """A multi-ring split that sends more attention bytes than ring over the same ranks is chosen only when its
    step is predicted faster beyond the model's resolution; the reasons say so either way."""
    from types import SimpleNamespace as NS

    from ds_wallfacer.planner.candidate import Candidate
    from ds_wallfacer.planner.search import _bytes_vs_ring

    def row(c, step_s, nbytes):
        return NS(candidate=Candidate(sp_size=4, ring_count=c), cost=NS(step_s=step_s, step_bytes=nbytes))

    ring = row(1, 1.000, 100)
    near, fast, lean = row(2, 0.995, 139), row(2, 0.95, 139), row(2, 0.999, 80)
    order, why = _bytes_vs_ring([near, ring])
    assert order[0] is ring and "ring chosen over" in why and "1.39x" in why
    order, why = _bytes_vs_ring([fast, ring])
    assert order[0] is fast and "1.39x" in why and "shorter" in why
    order, why = _bytes_vs_ring([lean, ring])
    assert order[0] is lean and "0.80x" in why
    assert _bytes_vs_ring([ring, near]) == ([ring, near], None)
    # real plans: a chosen multi-ring split never sends more than its ring twin unless predicted > 1% faster
    for cluster, seq, p in (("h100x64", 32768, 4), ("h100x8", 131072, 8), ("a100x32-eth", 65536, 4)):
        pl = plan(cluster, "llama3-8b", seq, fixed={"mode": "wallfacer", "sp_size": p})
        best = pl.rows[0]
        assert best.candidate == pl.choice.candidate
        if best.candidate.ring_count > 1:
            twin = next(r for r in pl.rows if r.fits and r.candidate.ring_count == 1
                        and r.candidate.mini_sequence == best.candidate.mini_sequence
                        and r.candidate.checkpointing == best.candidate.checkpointing)
            assert (best.cost.step_bytes <= twin.cost.step_bytes
                    or twin.cost.step_s > 1.01 * best.cost.step_s), (cluster, best.candidate.label)
            assert any("attention bytes of ring" in r for r in pl.choice.reasons)
