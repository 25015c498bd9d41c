"""Cost and memory model: the paper's worked example, volumes from ``attention.volume``, placement links,
memory terms (pure, in-process)."""
import pytest

from ds_wallfacer.attention.volume import AttnShape, ulysses_bytes, wallfacer_bytes
from ds_wallfacer.comm.layout import RankLayout
from ds_wallfacer.planner import (CLUSTERS, MODELS, Candidate, Workload, analyse_links, estimate, layer_bytes,
                                  layouts, memory_breakdown, paper_figures)
from ds_wallfacer.planner.paper import worked_example
from ds_wallfacer.planner.placement import peer_indices

GIB = 2**30


def test_paper_worked_example():
    e = worked_example()
    # As printed in the paper: GiB (2^30 bytes), counting P ring hops and P/C^2 sub-ring hops.
    assert e["ring_printed"] / GIB == 1.625
    assert round(e["collective_printed"] / GIB, 3) == 0.152
    assert e["wf_ring_printed"] / GIB == 0.40625
    assert round((e["collective_printed"] + e["wf_ring_printed"]) / GIB, 3) == 0.559  # paper: 0.558 (truncated)
    # In decimal GB the same bytes would read 1.745 / 0.164 / 0.436: the paper's "GB" are GiB.
    assert round(e["ring_printed"] / 1e9, 3) == 1.745
    # The formulas themselves count (P-1) and (P/C^2 - 1) hops; the implementation's ring equals them.
    assert e["ring_formula"] == e["ring_printed"] * 63 / 64 == e["impl_ring"]
    assert e["wf_ring_formula"] == e["wf_ring_printed"] * 3 / 4


def test_layer_bytes_are_volume_figures():
    m = MODELS["llama3-8b"]
    w = Workload(seq_len=65536)
    shape = AttnShape(1, 65536, 32, 8, 128, 2)
    assert layer_bytes(m, Candidate(sp_size=64, ring_count=4), w) == wallfacer_bytes(shape, sp_size=64, ring_count=4, local=1)
    assert layer_bytes(m, Candidate(sp_size=64, ring_count=4), w, sp_index=0) == wallfacer_bytes(shape, sp_size=64, ring_count=4, local=0)
    assert layer_bytes(m, Candidate(sp_size=8, ring_count=1, ulysses_degree=8), w) == ulysses_bytes(shape, degree=8, sp_size=8)
    hyb = layer_bytes(m, Candidate(sp_size=64, ring_count=2, ulysses_degree=4), w)
    inner = wallfacer_bytes(AttnShape(1, 65536, 8, 2, 128, 2), sp_size=16, ring_count=2, local=1)
    assert hyb["forward"]["all_to_all"] == ulysses_bytes(shape, degree=4, sp_size=64)["forward"]["all_to_all"]
    assert hyb["forward"]["ring"] == inner["forward"]["ring"]


def test_latent_attention_counts_both_head_dims():
    """MLA (DeepSeek-V3's config defaults): q/k heads of 128 + 64, v and output heads of 128; k and v travel at
    their own sizes, partial outputs at v's."""
    from transformers import DeepseekV3Config

    from ds_wallfacer.planner import ModelSpec

    spec = ModelSpec.from_hf_config(DeepseekV3Config())
    assert (spec.head_dim, spec.value_head_dim, spec.kv_heads) == (192, 128, 128)
    cand, work = Candidate(sp_size=8, ring_count=2, ulysses_degree=1), Workload(seq_len=8192, batch=1, elem_bytes=2)
    fwd = layer_bytes(spec, cand, work)["forward"]
    rows = 128 * 8192 // 8  # heads x tokens per rank
    assert fwd["ring"] == (8 // 4 - 1) * 2 * rows * (192 + 128) * 2  # (G - 1) C (n_k + n_v) s
    assert fwd["reduce_scatter"] == (2 - 1) * rows * (128 * 2 + 4)  # (C - 1) (n_o a_out + the fp32 lse)
    assert fwd["all_gather"] == (2 - 1) * rows * 192 * 2  # the team's q
    assert spec.layer_params > ModelSpec("same", layers=1, hidden=spec.hidden, heads=128, kv_heads=128,
                                         intermediate=spec.intermediate, vocab=spec.vocab, head_dim=128).layer_params


@pytest.mark.parametrize("p", [4, 16, 64, 144])
def test_peer_arithmetic_equals_rank_layout(p):
    for c in (c for c in range(1, p + 1) if p % (c * c) == 0):
        lay = RankLayout(tuple(range(p)), c)
        want = [(pl.team_ranks[(pl.local + 1) % c], pl.ring_next, pl.kv_dests, pl.home_dests) for pl in lay.places]
        assert list(peer_indices(p, c)) == want


def test_placement_layouts_and_links():
    h = CLUSTERS["h100x64"]
    team = Candidate(sp_size=64, ring_count=4)
    ring = Candidate(sp_size=64, ring_count=4, placement="ring-inner")
    lt, lr = analyse_links(team, h), analyse_links(ring, h)
    assert lt.team.offnode == 0 and lt.ring.offnode > 0  # teams inside nodes, sub-rings leave them
    assert lr.ring.offnode == 0 and lr.team.offnode > 0  # sub-rings (G = 4) inside nodes, teams span them
    lay = layouts(ring, 64, 8)
    assert len(lay) == 1 and lay[0].teams_cross_nodes()
    hyb = layouts(Candidate(sp_size=16, ring_count=2, ulysses_degree=2), 32)  # 2 SP groups x U = 2 rings of R = 8
    assert [lay.ranks[:3] for lay in hyb] == [(0, 2, 4), (1, 3, 5), (16, 18, 20), (17, 19, 21)]
    assert analyse_links(Candidate(sp_size=8, ring_count=1, ulysses_degree=8), h).a2a.offnode == 0
    assert analyse_links(Candidate(sp_size=16, ring_count=1, ulysses_degree=16), h).a2a.offnode == 1


def test_memory_terms():
    m = MODELS["llama2-7b"]  # multi-head attention: the paper's term 3(C-1) B N H / P applies exactly
    w = Workload(seq_len=131072)
    cl = CLUSTERS["h100x64"]
    for c in (1, 2, 4):
        mem = memory_breakdown(m, cl, Candidate(sp_size=64, ring_count=c), w)
        assert mem.team_copies == 3 * (c - 1) * 131072 * m.hidden // 64 * 2
    on = memory_breakdown(m, cl, Candidate(sp_size=8, ring_count=1, mini_sequence=True, mlp_chunk_tokens=4096, lm_head_chunk_tokens=512), w)
    off = memory_breakdown(m, cl, Candidate(sp_size=8, ring_count=1, mini_sequence=False), w)
    assert on.lm_head < off.lm_head and on.total <= off.total  # here the ring's attention point is the peak
    one = Workload(seq_len=16384)
    assert (memory_breakdown(m, cl, Candidate(sp_size=1, mini_sequence=True, mlp_chunk_tokens=4096,
                                              lm_head_chunk_tokens=512), one).total
            < memory_breakdown(m, cl, Candidate(sp_size=1, mini_sequence=False), one).total)
    # without MsT the LM-head term holds the fp32 logits of 16K local tokens x 32K vocab and their bf16 cast
    assert off.lm_head > 16384 * 32000 * (4 + 2)
    no_ac = memory_breakdown(m, cl, Candidate(sp_size=8, ring_count=1, checkpointing=False), w)
    assert no_ac.checkpoints > 5 * off.checkpoints
    # kept attention: every layer's output and lse; recomputing it instead moves one layer's into the working set
    keep = memory_breakdown(m, cl, Candidate(sp_size=1), Workload(seq_len=65536))
    again = memory_breakdown(m, cl, Candidate(sp_size=1, keep_attention=False), Workload(seq_len=65536))
    per_layer = 65536 * m.heads * (m.head_dim * 2 + 4)
    assert keep.kept == m.layers * per_layer and again.kept == 0
    assert again.attention - keep.attention == per_layer


def test_offloads_move_state_to_the_host():
    m, cl = MODELS["llama3-8b"], CLUSTERS["h200x1"]
    cand = Candidate(sp_size=1)
    base = memory_breakdown(m, cl, cand, Workload(seq_len=262144))
    off = memory_breakdown(m, cl, cand, Workload(seq_len=262144, offload_optimizer=True, offload_checkpoints=True,
                                                 offload_params=True))
    x = 262144 * m.hidden * 2
    assert base.host == 0 and off.optimizer == 0 and off.weights < base.weights / 5
    assert base.checkpoints - off.checkpoints == (m.layers - 1) * x
    assert off.host == 16 * m.params + 2 * m.params + m.layers * x  # optimizer state, parameters, checkpoints
    with pytest.raises(ValueError, match="ZeRO stage 3"):
        Workload(seq_len=1024, zero_stage=2, offload_params=True)


def test_direction_matches_paper():
    """Across nodes at 64K-128K WallFacer C = 2 or 4 beats ring; inside one node the gap shrinks."""
    m = MODELS["llama-30b-like"]
    h = CLUSTERS["h100x64"]
    for n, p in ((65536, 64), (131072, 32)):
        w = Workload(seq_len=n)
        ring = estimate(m, h, Candidate(sp_size=p, ring_count=1), w)
        for c in (2, 4):
            assert estimate(m, h, Candidate(sp_size=p, ring_count=c), w).step_s < ring.step_s
    w = Workload(seq_len=65536)
    across = estimate(m, h, Candidate(sp_size=64, ring_count=1), w).step_s / estimate(m, h, Candidate(sp_size=64, ring_count=2), w).step_s
    node = estimate(m, h, Candidate(sp_size=8, ring_count=1), w).step_s / estimate(m, h, Candidate(sp_size=8, ring_count=2), w).step_s
    assert node < across and node < 1.1
    # without overlap the ring's exposed communication grows
    assert estimate(m, h, Candidate(sp_size=64, ring_count=1), Workload(65536, overlap=False)).step_s > across * 0 + estimate(
        m, h, Candidate(sp_size=64, ring_count=1), w).step_s


def test_paper_figures_without_sub_ring():
    shape = AttnShape(1, 4096, 8, 8, 64, 2)
    f = paper_figures(shape, sp_size=4, ring_count=2)  # G = 1: no ring hops at all
    assert f["wf_ring_formula"] == f["wf_ring_printed"] == 0
