"""Attention sinks (gpt-oss) and value head dims unlike query/key's (MLA) in every mode, on 4 gloo ranks: outputs,
q/k/v gradients and the sinks' gradient (summed over the ranks, as DeepSpeed sums parameter gradients) against the
float64 single-process reference, and the bytes each rank sent against ``volume.py``'s formulas with both head dims.
P = 1 (local attention) runs in the test process."""
from __future__ import annotations

import pytest
import torch

from tests.attention.reference import document_mask, full_inputs, reference_attention
from tests.dist_utils import run_distributed

B, N, HQ, HK = 2, 32, 4, 2
TOL = 1e-5
# (mode, U, C, head dim, value head dim, sinks, window)
CASES = [
    ("wallfacer", 1, 1, 16, 16, True, None),  # ring attention with sinks
    ("wallfacer", 1, 1, 16, 8, False, None),  # ring attention, MLA
    ("wallfacer", 1, 1, 16, 8, True, 6),  # both, sliding window (gpt-oss alternates windowed layers)
    ("wallfacer", 1, 2, 16, 8, True, None),  # multi-ring C = 2
    ("wallfacer", 1, 2, 8, 16, True, 6),  # v wider than q/k
    ("ulysses", 4, 1, 16, 8, True, None),  # U = 4 > hk: kv heads replicated; each rank its own head's sink
    ("hybrid", 2, 1, 16, 8, True, None),
    ("hybrid", 2, 1, 16, 16, True, 6),
]


def _reference(case, seed):
    _, _, _, d, dv, with_sinks, window = case
    q, k, v, do = full_inputs(batch=B, q_heads=HQ, kv_heads=HK, seq_len=N, head_dim=d, value_dim=dv,
                              dtype=torch.float32, seed=seed)
    sinks = torch.randn(HQ, generator=torch.Generator().manual_seed(seed)) if with_sinks else None
    keep = None if window is None else document_mask([[N]] * B, window=window)
    return (q, k, v, do, sinks), reference_attention(q, k, v, do, causal=True, keep=keep, sinks=sinks)


def _max_errors(got, want) -> list[float]:
    return [(g.double() - w).abs().max().item() for g, w in zip(got, want)]


def _run(rank: int, world: int, cases: list) -> list:
    from ds_wallfacer.attention import AttnShape, ulysses_bytes, wallfacer_bytes
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.data import shard_sequence
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel
    from ds_wallfacer.planner.auto import ParallelSetup

    results = []
    for i, case in enumerate(cases):
        mode, u, c, d, dv, with_sinks, window = case
        dims = ParallelDims(world_size=world, sp_size=world, mode=mode, ulysses_degree=u, ring_count=c,
                            num_heads=HQ, num_kv_heads=HK)
        groups = build_sequence_parallel(ParallelSetup(dims))
        comm = CommLayer()
        attn = attention_for(groups, comm=comm)
        (q, k, v, do, sinks), truth = _reference(case, seed=i)

        def sh(x):
            return shard_sequence(x, dim=2, index=groups.shard_index, sp_size=world, ulysses_degree=u)

        ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
        s = None if sinks is None else sinks.clone().requires_grad_()
        out = attn(ql, kl, vl, causal=True, window=window, sinks=s)
        out.backward(sh(do))
        errs = _max_errors([out, ql.grad, kl.grad, vl.grad], [sh(t) for t in truth[:4]])
        sent = {ph: dict(comm.by_kind(ph)) for ph in ("forward", "backward")}
        want = {}
        if u > 1:
            want = ulysses_bytes(AttnShape(B, N, HQ, HK, d, elem_bytes=4, value_dim=dv), degree=u, sp_size=world)
        if groups.wallfacer is not None and window is None:  # a window may end the ring early (fewer steps)
            inner = AttnShape(B, N, HQ // u, max(HK, u) // u, d, elem_bytes=4, value_dim=dv)
            wf = wallfacer_bytes(inner, sp_size=dims.ring_size, ring_count=c, local=groups.wallfacer.place.local)
            want = {ph: {**want.get(ph, {}), **wf[ph]} for ph in wf}
        got = {ph: {kind: sent[ph].get(kind, 0) for kind in want.get(ph, {})} for ph in want}
        results.append(dict(errs=errs, dsinks=None if s is None else s.grad, got=got, want=want))
    return results


def test_sinks_and_value_dims_match_single_process_in_every_mode():
    by_rank = run_distributed(_run, 4, CASES, timeout_s=300)
    for i, case in enumerate(CASES):
        truth = _reference(case, seed=i)[1]
        for rank, res in enumerate(r[i] for r in by_rank):
            assert max(res["errs"]) <= TOL, f"{case} rank {rank}: out/dq/dk/dv errors {res['errs']}"
            assert res["got"] == res["want"], f"{case} rank {rank}: bytes {res['got']} != formulas {res['want']}"
        if case[5]:  # each rank's partial sum over its own rows; their sum is the sinks' gradient
            total = sum(r[i]["dsinks"] for r in by_rank)
            err = (total.double() - truth[4]).abs().max().item()
            assert err <= TOL, f"{case}: d sinks error {err}"
            assert all(r[i]["dsinks"].abs().max() > 0 for r in by_rank), "a rank's sink gradient is zero"


@pytest.mark.parametrize("kernel", ["cpu_flash", "reference"])
@pytest.mark.parametrize("d,dv,window", [(16, 8, None), (8, 16, 6), (16, 16, None)])
def test_local_attention_with_sinks_and_value_dim(kernel, d, dv, window):
    """P = 1: local attention (one call, or window tiles); the fused CPU op needs one head dim and is padded."""
    from ds_wallfacer.attention.ulysses import LocalAttention

    case = ("local", 1, 1, d, dv, True, window)
    (q, k, v, do, sinks), truth = _reference(case, seed=7)
    ql, kl, vl, s = (x.clone().requires_grad_() for x in (q, k, v, sinks))
    out = LocalAttention(kernel=kernel)(ql, kl, vl, causal=True, window=window, sinks=s)
    out.backward(do)
    errs = _max_errors([out, ql.grad, kl.grad, vl.grad, s.grad], truth)
    assert max(errs) <= TOL, errs


def _one_rank_group(rank: int, world: int) -> list[list[float]]:
    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.comm import RankLayout, build_groups

    attn = WallFacerAttention(build_groups([RankLayout((0,), 1)]), kernel="cpu_flash")
    errs = []
    for window in (None, 6):  # one kernel call; window tiles merged in the accumulators
        (q, k, v, do, sinks), truth = _reference(("wallfacer", 1, 1, 16, 8, True, window), seed=3)
        ql, kl, vl, s = (x.clone().requires_grad_() for x in (q, k, v, sinks))
        out = attn(ql, kl, vl, causal=True, window=window, sinks=s)
        out.backward(do)
        errs.append(_max_errors([out, ql.grad, kl.grad, vl.grad, s.grad], truth))
    return errs


def test_wallfacer_on_a_one_rank_group():
    for errs in run_distributed(_one_rank_group, 1, timeout_s=120)[0]:
        assert max(errs) <= TOL, errs
