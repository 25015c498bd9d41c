"""Ulysses and the hybrid at the attention level, on 4 and 8 gloo ranks: outputs and q/k/v gradients against
single-process attention over the full sequence (fp32), exact all-to-all bytes against ``ulysses_bytes`` (and
WallFacer's against ``wallfacer_bytes`` inside the hybrid), and start-up errors that every rank raises together.
One launch per world size runs every case."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist_utils import run_distributed

B, D = 2, 8
# (mode, U, C, sharding, hq, hk, causal, seq_len)
CASES_4 = [
    ("ulysses", 4, 1, "zigzag", 4, 2, True, 32),  # U = 4 > hk = 2: kv heads replicated
    ("ulysses", 4, 1, "zigzag", 8, 4, False, 16),
    ("hybrid", 2, 1, "zigzag", 4, 2, True, 32),
    ("hybrid", 2, 1, "contiguous", 6, 2, True, 24),
    ("wallfacer", 1, 2, "zigzag", 4, 1, True, 16),
]
CASES_8 = [
    ("ulysses", 8, 1, "zigzag", 8, 2, True, 32),
    ("hybrid", 2, 2, "zigzag", 4, 2, True, 32),  # Ulysses 2 x WallFacer R = 4, C = 2
    ("hybrid", 4, 1, "zigzag", 4, 4, False, 32),
    ("hybrid", 2, 1, "contiguous", 2, 1, True, 64),  # R = 4 plain ring, kv replicated
]


def _reference(q, k, v, causal):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal
    )


def _attention_cases(rank: int, world: int, cases: list) -> list[str]:
    from ds_wallfacer.attention import AttnShape, ulysses_bytes, wallfacer_bytes
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.planner.auto import ParallelSetup
    from ds_wallfacer.data import shard_sequence
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel

    failures = []
    for mode, u, c, sharding, hq, hk, causal, n in cases:
        name = f"{mode} U={u} C={c} {sharding} hq={hq} hk={hk} causal={causal} N={n}"
        dims = ParallelDims(world_size=world, sp_size=world, mode=mode, ulysses_degree=u, ring_count=c, num_heads=hq,
                            num_kv_heads=hk)
        lay = ParallelSetup(dims, sharding=sharding)
        groups = build_sequence_parallel(lay)
        comm = CommLayer()
        attn = attention_for(groups, comm=comm)
        g = torch.Generator().manual_seed(n * 100 + hq)
        q, dout = (torch.randn(B, hq, n, D, generator=g) for _ in range(2))
        k, v = (torch.randn(B, hk, n, D, generator=g) for _ in range(2))
        for t in (q, k, v):
            t.requires_grad_(True)
        ref = _reference(q, k, v, causal)
        ref.backward(dout)

        def sh(x):
            return shard_sequence(x.detach(), dim=2, index=groups.shard_index, sp_size=world, ulysses_degree=u,
                                  scheme=sharding)

        ql, kl, vl = (sh(t).requires_grad_(True) for t in (q, k, v))
        out = attn(ql, kl, vl, causal=causal)
        out.backward(sh(dout))
        for what, got, want in (("out", out, ref), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
                                ("dv", vl.grad, v.grad)):
            if not torch.allclose(got, sh(want), atol=2e-5, rtol=1e-4):
                failures.append(f"{name}: {what} max err {(got - sh(want)).abs().max().item():.3g}")
        shape = AttnShape(B, n, hq, hk, D, elem_bytes=4)
        want_a2a = ulysses_bytes(shape, degree=u, sp_size=world) if u > 1 else None
        for phase in ("forward", "backward"):
            sent = comm.by_kind(phase)
            if want_a2a is not None and sent["all_to_all"] != want_a2a[phase]["all_to_all"]:
                failures.append(f"{name}: {phase} all_to_all bytes {sent['all_to_all']} != "
                                f"ulysses_bytes {want_a2a[phase]['all_to_all']}")
            if groups.wallfacer is not None:
                hk_u = max(hk, u) // u  # kv heads per rank after the all-to-all (replicated when hk < U)
                inner = AttnShape(B, n, hq // u, hk_u, D, elem_bytes=4)
                want_wf = wallfacer_bytes(inner, sp_size=dims.ring_size, ring_count=c,
                                          local=groups.wallfacer.place.local)[phase]
                got_wf = {kind: sent[kind] for kind in want_wf}
                if got_wf != want_wf:
                    failures.append(f"{name}: {phase} WallFacer bytes {got_wf} != {want_wf}")
    return failures


def _startup_errors(rank: int, world: int) -> list[str]:
    """Bad configurations: the same clear error on every rank, before any collective could hang."""
    from ds_wallfacer.integration import initialize

    from tests.integration.models import tiny_model

    out = []
    for wf in ({"mode": "wallfacer", "ring_count": 3},  # 9 does not divide 4
               {"mode": "hybrid", "ulysses_degree": 8},  # does not divide P = 4
               {"sequence_parallel_size": 3},  # does not divide the world
               {"mode": "ulysses", "ring_size": 2}):  # unknown key
        try:
            initialize(model=tiny_model("llama"), config={"train_micro_batch_size_per_gpu": 1, "wallfacer": wf})
            out.append("no error")
        except ValueError as e:
            out.append(str(e))
    return out


def _data_errors(rank: int, world: int) -> list[str]:
    """Diverging batches across the sequence-parallel group, and a length that is not padded."""
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.planner.auto import ParallelSetup
    from ds_wallfacer.data import ShardSpec, prepare_batch
    from ds_wallfacer.integration.parallel import build_sequence_parallel, check_same_batch

    lay = ParallelSetup(ParallelDims(world_size=world, sp_size=world, num_heads=4, num_kv_heads=2))
    groups = build_sequence_parallel(lay)
    out = []
    check_same_batch({"input_ids": torch.arange(16)[None]}, group=groups.sp_group, comm=CommLayer())
    try:
        check_same_batch({"input_ids": torch.arange(16)[None] + (rank == 2)}, group=groups.sp_group, comm=CommLayer())
        out.append("no error")
    except ValueError as e:
        out.append(str(e).split(" (")[0])
    try:
        prepare_batch({"input_ids": torch.arange(30)[None]}, ShardSpec(index=rank, sp_size=world), pad=False)
        out.append("no error")
    except ValueError as e:
        out.append(str(e))
    return out


def _all(rank: int, world: int, cases: list) -> dict:
    res = {"attention": _attention_cases(rank, world, cases)}
    if world == 4:
        res["startup"] = _startup_errors(rank, world)
        res["data"] = _data_errors(rank, world)
    return res


@pytest.mark.parametrize("world,cases", [(4, CASES_4), (8, CASES_8)], ids=["P4", "P8"])
def test_ulysses_and_hybrid_attention(world: int, cases: list) -> None:
    results = run_distributed(_all, world, cases, timeout_s=300)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["attention"]]
    assert not failures, "\n".join(failures[:30])
    if world != 4:
        return
    startup = [res["startup"] for res in results]
    assert all(s == startup[0] for s in startup), "ranks raised different start-up errors"
    ring, ulysses, sp_size, unknown = startup[0]
    assert "ring_count = 3" in ring and "Valid ring counts: [1, 2]" in ring
    assert "ulysses_degree = 8 does not divide sequence_parallel_size 4" in ulysses and "[1, 2, 4]" in ulysses
    assert "sequence_parallel_size = 3 does not divide the world size 4" in sp_size
    assert "unknown key(s) ['ring_size']" in unknown and "ring_count" in unknown
    data = [res["data"] for res in results]
    assert all(d[0].startswith("the ranks of a sequence-parallel group received different batches") for d in data)
    assert all("sequence length 30 is not divisible by 2 x sequence_parallel_size = 8" in d[1] for d in data)
