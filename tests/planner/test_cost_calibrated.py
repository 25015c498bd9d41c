"""The cost model's structure with a device calibration (planner/calibrate.py, docs/design/planner.md Note [Cost
model]): exposed communication never exceeds all of it, a cached calibration is reused and not measured again,
GPU presets keep their datasheet figures without a cache, the per-call term grows with the calls, ranks beyond the
cores stretch the busy time. Pure: a synthetic calibration, no measurement, no timed assertion."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from ds_wallfacer.planner import calibrate
from ds_wallfacer.planner.calibrate import Calibration
from ds_wallfacer.planner.candidate import Candidate, Workload
from ds_wallfacer.planner.cluster import CLUSTERS
from ds_wallfacer.planner.cost import estimate, kernel_calls
from ds_wallfacer.planner.model import MODELS, ModelSpec

TINY = ModelSpec("tiny", layers=2, hidden=128, heads=8, kv_heads=4, intermediate=256, vocab=256)

FAKE = Calibration(
    device="cpu test", torch="0", threads=1, cores=2,
    gemm=((1e6, 2e10), (1e9, 6e10)), attention=((1e7, 1e10), (1e9, 3e10)), attention_full=((1e7, 2e10), (1e9, 4e10)),
    op_s=1e-5, mem_bw=1e10, adam_s_per_param=3e-9, collective_s=((1.0, 5e-4, 2e-4), (2.0, 4e-3, 8e-4)),
)


def _cands(p: int) -> list[Candidate]:
    out = [Candidate(sp_size=p, ring_count=1)]
    if p % 4 == 0:
        out.append(Candidate(sp_size=p, ring_count=2))
    out += [Candidate(sp_size=p, ulysses_degree=2, ring_count=1), Candidate(sp_size=p, ring_count=1,
                                                                             keep_attention=False)]
    return out


@pytest.mark.parametrize("cluster,model,n", [("h100x64", "llama-30b-like", 65536), ("a100x32-eth", "llama3-8b", 131072),
                                              ("cpu", "tiny", 2048)])
def test_exposed_communication_never_exceeds_all_of_it(cluster, model, n):
    cl = CLUSTERS[cluster]
    m = TINY if model == "tiny" else MODELS[model]
    if cluster == "cpu":
        cl = replace(cl.with_world_size(4), calibration=FAKE)
    for p in (4, 8, 16):
        if p > cl.world_size:
            continue
        for cand in _cands(p):
            for overlap in (True, False):
                k = estimate(m, cl, cand, Workload(seq_len=n, overlap=overlap))
                attn = k.detail["attention_exposed_s"]
                assert 0 <= attn <= k.comm_s * (1 + 1e-12), (cand.label, overlap)
                if not overlap:
                    assert attn == pytest.approx(k.comm_s), cand.label  # nothing hidden
                assert k.step_s >= k.compute_s


def test_overlap_hides_multi_ring_exchanges_on_gpus():
    """The paper's setting: the pipelined team exchanges and the ring hops hide behind the block kernels; what
    stays is at least the first remote piece and the dk/dv sent home."""
    m, cl = MODELS["llama-30b-like"], CLUSTERS["h100x64"]
    for n in (65536, 262144):
        on = estimate(m, cl, Candidate(sp_size=64, ring_count=4), Workload(seq_len=n))
        off = estimate(m, cl, Candidate(sp_size=64, ring_count=4), Workload(seq_len=n, overlap=False))
        assert 0 < on.detail["attention_exposed_s"] < off.detail["attention_exposed_s"] == pytest.approx(off.comm_s)
    # long enough that the kernels outlast the exchanges: only the unhideable pieces remain
    k = estimate(m, cl, Candidate(sp_size=8, ring_count=2), Workload(seq_len=262144))
    assert k.detail["attention_exposed_s"] < 0.5 * k.comm_s


def test_cached_calibration_is_reused_not_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_WALLFACER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DS_WALLFACER_CALIBRATION", raising=False)
    calls = []

    def fake_measure(device="cpu", **_):
        calls.append(device)
        return FAKE

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    assert calibrate.load("cpu") is None
    first = calibrate.load_or_measure("cpu")
    assert calls == ["cpu"] and first == FAKE
    path = calibrate.cache_path("cpu")
    assert path.parent == tmp_path and json.loads(path.read_text())["op_s"] == FAKE.op_s
    # the "auto" path's helper: the cached file, no second measurement
    cl = calibrate.calibrated(CLUSTERS["cpu"])
    assert cl.calibration == FAKE and calls == ["cpu"]
    assert calibrate.load_or_measure("cpu") == FAKE and calls == ["cpu"]
    # forced: measured again
    calibrate.load_or_measure("cpu", force=True)
    assert calls == ["cpu", "cpu"]
    # switched off: the preset as it is
    monkeypatch.setenv("DS_WALLFACER_CALIBRATION", "off")
    assert calibrate.calibrated(CLUSTERS["cpu"]).calibration is None


def test_gpu_presets_keep_datasheet_figures_without_a_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_WALLFACER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("DS_WALLFACER_CALIBRATION", raising=False)
    monkeypatch.setattr(calibrate, "measure", lambda *a, **k: pytest.fail("a GPU preset must not measure"))
    import torch

    # a CPU calibration in the cache is never a GPU preset's, on a host with or without a GPU
    monkeypatch.setattr(calibrate, "cache_path", lambda device="cpu": tmp_path / f"calibration-{device}.json")
    (tmp_path / "calibration-cpu.json").write_text(json.dumps(FAKE.to_json()))
    assert calibrate.calibrated(CLUSTERS["h100x64"]).calibration is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert calibrate.calibrated(CLUSTERS["h100x64"]).calibration is None
    (tmp_path / "calibration-cuda.json").write_text(json.dumps(FAKE.to_json()))
    assert calibrate.calibrated(CLUSTERS["h100x64"]).calibration == FAKE  # a measured cache for the device wins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert calibrate.calibrated(CLUSTERS["h100x64"]).calibration is None  # no GPU here: the datasheet


def test_per_call_term_grows_with_calls():
    cl = replace(CLUSTERS["cpu"].with_world_size(4), calibration=FAKE)
    w = Workload(seq_len=4096, zero_stage=1, elem_bytes=4)
    coarse = estimate(TINY, cl, Candidate(sp_size=4, mlp_chunk_tokens=1024, lm_head_chunk_tokens=1024), w)
    fine = estimate(TINY, cl, Candidate(sp_size=4, mlp_chunk_tokens=64, lm_head_chunk_tokens=64), w)
    assert fine.ops > coarse.ops and fine.overhead_s > coarse.overhead_s
    deeper = estimate(replace(TINY, layers=4), cl, Candidate(sp_size=4), w)
    assert deeper.ops > estimate(TINY, cl, Candidate(sp_size=4), w).ops
    # more ring steps: more block-kernel calls
    assert kernel_calls(Candidate(sp_size=8)) > kernel_calls(Candidate(sp_size=4))
    # a slower tiny call: a longer step, by ops x the difference, stretched by the oversubscription
    slow = estimate(TINY, replace(cl, calibration=replace(FAKE, op_s=2e-5)), Candidate(sp_size=4), w)
    base = estimate(TINY, cl, Candidate(sp_size=4), w)
    assert slow.step_s - base.step_s == pytest.approx(base.ops * 1e-5 * base.oversubscription)
    # without a calibration there is no per-call term
    assert estimate(TINY, CLUSTERS["cpu"].with_world_size(4), Candidate(sp_size=4), w).overhead_s == 0


def test_ranks_beyond_the_cores_stretch_the_busy_time():
    w = Workload(seq_len=4096, zero_stage=1, elem_bytes=4)
    two = estimate(TINY, replace(CLUSTERS["cpu"].with_world_size(2), calibration=FAKE), Candidate(sp_size=2), w)
    four = estimate(TINY, replace(CLUSTERS["cpu"].with_world_size(4), calibration=FAKE), Candidate(sp_size=4), w)
    assert two.oversubscription == 1.0 and four.oversubscription == 2.0
    assert FAKE.latency("collective", 2.0) == pytest.approx(4e-3) and FAKE.latency("collective", 4.0) > 4e-3


def test_calibration_rates_interpolate_in_log_size():
    assert FAKE.gemm_rate(1e3) == 2e10 and FAKE.gemm_rate(1e12) == 6e10
    assert FAKE.gemm_rate(10 ** 7.5) == pytest.approx(4e10)
    assert Calibration.from_json(json.loads(json.dumps(FAKE.to_json()))) == FAKE
