"""WallFacer attention on several gloo ranks against a single-process float64 reference.

One process launch per P runs every case for that P (ring counts, causal or not, GQA, batch 2, head dims
64 and 128, fp32 and bf16, zigzag and contiguous, the summed tensors in their default dtypes or all in fp32 /
all in bf16), and also asserts the exact bytes each rank sent.
"""
import pytest
import torch

from ds_wallfacer.attention.kernels.base import expand_kv, reduce_kv_grad
from ds_wallfacer.attention.kernels.reference import ReferenceKernel
from tests.dist_utils import run_distributed

SEQ_PER_RANK = 16


class DeltaKernel(ReferenceKernel):
    """The reference kernel plus a backward from delta = rowsum(dO * out)
    (wallfacer.py Note [Backward without out]), so the team gathers delta instead of out; its plain backward is
    never called with P > 1."""

    name = "reference_delta"

    def backward(self, dout, q, k, v, out, lse, **options):
        if out is None:
            raise AssertionError("backward called without out")
        return super().backward(dout, q, k, v, out, lse, **options)

    def backward_delta(self, dout, q, k, v, delta, lse, *, causal, scale, mask=None, softcap=0.0):
        assert mask is None and not softcap
        dt = torch.float64 if q.dtype == torch.float64 else torch.float32
        hq, hk = q.shape[1], k.shape[1]
        qd, ke, ve, do = q.to(dt), expand_kv(k, hq).to(dt), expand_kv(v, hq).to(dt), dout.to(dt)
        s = torch.matmul(qd, ke.transpose(-1, -2)) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
        p = torch.exp(s - lse.to(dt).unsqueeze(-1))
        ds = p * (torch.matmul(do, ve.transpose(-1, -2)) - delta.to(dt).unsqueeze(-1)) * scale
        dv = torch.matmul(p.transpose(-1, -2), do)
        return torch.matmul(ds, ke), reduce_kv_grad(torch.matmul(ds.transpose(-1, -2), qd), hk), reduce_kv_grad(dv, hk)


def _cases(world):
    for c in [1, 2, 4]:
        if world % (c * c):
            continue
        for causal in (True, False):
            for hq, hk, d in ((4, 4, 64), (4, 2, 128), (8, 2, 64)):
                yield dict(c=c, causal=causal, hq=hq, hk=hk, d=d, dtype=torch.float32, sharding="zigzag")
        yield dict(c=c, causal=True, hq=4, hk=2, d=64, dtype=torch.bfloat16, sharding="zigzag")
        yield dict(c=c, causal=True, hq=8, hk=2, d=64, dtype=torch.bfloat16, sharding="zigzag")
        yield dict(c=c, causal=True, hq=4, hk=2, d=64, dtype=torch.float32, sharding="contiguous")
    if world >= 4:  # the summed tensors all in fp32, all in bf16: bytes as derived, bf16 error still bounded
        c = 2 if world % 4 == 0 else 1
        for sums in ("float32", "input"):
            yield dict(c=c, causal=True, hq=8, hk=2, d=64, dtype=torch.bfloat16, sharding="zigzag", sums=sums)
        # a kernel that takes delta: the team gathers 4 bytes per row instead of out; the team's q kept for backward
        yield dict(c=c, causal=True, hq=8, hk=2, d=64, dtype=torch.float32, sharding="zigzag", kernel="delta")
        yield dict(c=c, causal=True, hq=8, hk=2, d=64, dtype=torch.bfloat16, sharding="zigzag", keep_q=True)


def _references(world, cases):
    """Per case: the full inputs, the float64 reference and the same kernel's error on the full sequence in one
    process (for the low-precision bound). Computed once here, not once per rank."""
    from ds_wallfacer.attention.kernels import get_kernel
    from tests.attention.reference import full_inputs, reference_attention

    refs = []
    for i, case in enumerate(cases):
        q, k, v, do = full_inputs(batch=2, q_heads=case["hq"], kv_heads=case["hk"], seq_len=SEQ_PER_RANK * world,
                                  head_dim=case["d"], dtype=case["dtype"], seed=i)
        truth = reference_attention(q, k, v, do, causal=case["causal"])
        kern = get_kernel("cpu_flash", q)
        scale = case["d"] ** -0.5
        o1, lse1 = kern.forward(q, k, v, causal=case["causal"], scale=scale)
        g1 = kern.backward(do, q, k, v, o1, lse1, causal=case["causal"], scale=scale)
        single = [(a.double() - b).abs().max().item() for a, b in zip([o1, *g1], truth)]
        refs.append(((q, k, v, do), truth, single))
    return refs


def _run_cases(rank, world, cases, refs):
    from ds_wallfacer.attention import AttnShape, WallFacerAttention, wallfacer_bytes
    from ds_wallfacer.attention.volume import SumDtypes
    from tests.attention.reference import shard_errors
    from ds_wallfacer.comm import RankLayout, build_groups
    from ds_wallfacer.data import shard_sequence

    groups = {c: build_groups([RankLayout(tuple(range(world)), c)]) for c in {case["c"] for case in cases}}
    results = []
    for case, ((q, k, v, do), truth, single) in zip(cases, refs):
        n = SEQ_PER_RANK * world
        sh = lambda x: shard_sequence(x, dim=2, index=rank, sp_size=world, scheme=case["sharding"])  # noqa: E731
        kernel = DeltaKernel() if case.get("kernel") == "delta" else "cpu_flash"
        attn = WallFacerAttention(groups[case["c"]], kernel=kernel, sharding=case["sharding"])
        if "sums" in case:
            attn.accum_comm_dtype = SumDtypes.uniform(case["sums"])
        attn.keep_team_q = case.get("keep_q", False)
        ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
        out = attn(ql, kl, vl, causal=case["causal"])
        out.backward(sh(do))
        errs = shard_errors([out, ql.grad, kl.grad, vl.grad], list(truth), sh)
        shape = AttnShape(2, n, case["hq"], case["hk"], case["d"], elem_bytes=q.element_size())
        want = wallfacer_bytes(shape, sp_size=world, ring_count=case["c"], local=groups[case["c"]].place.local,
                               sums=attn.sum_dtypes, gather_out=case.get("kernel") != "delta",
                               q_kept=attn.keep_team_q)
        got = {ph: {kd: b for kd, b in attn.comm.by_kind(ph).items() if kd in want[ph]} for ph in want}
        others = {ph: {kd: b for kd, b in attn.comm.by_kind(ph).items() if kd not in want[ph]} for ph in want}
        results.append(dict(case=case, errs=errs, single=single, bytes=got, want=want, others=others,
                            work=attn.work["forward"]))
    return results


def _check(results_by_rank, world):
    for i, case in enumerate(results_by_rank[0]):
        c = case["case"]
        label = f"P={world} {c}"
        for r in results_by_rank:
            res = r[i]
            assert res["bytes"] == res["want"], f"{label}: bytes sent {res['bytes']} != derived {res['want']}"
            # nothing but WallFacer's own kinds and the forward's input check
            assert not any(b for kd, b in res["others"]["forward"].items() if kd != "check"), res["others"]
            assert not any(res["others"]["backward"].values()), res["others"]
            if c["dtype"] == torch.float32:
                assert max(res["errs"]) <= 1e-5, f"{label}: errors {res['errs']}"
            else:  # bf16: no worse than twice the same kernel run on the full sequence in one process
                for name, e, e1 in zip("o dq dk dv".split(), res["errs"], res["single"]):
                    assert e <= 2 * e1, f"{label}: bf16 {name} error {e:.3g} > 2 x single-process {e1:.3g}"
        work = [r[i]["work"] for r in results_by_rank]
        if c["causal"] and c["sharding"] == "zigzag" and world > 1:
            assert max(work) / (sum(work) / world) <= 1.05, f"{label}: work {work}"


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_wallfacer_matches_single_process(world):
    cases = list(_cases(world))
    _check(run_distributed(_run_cases, world, cases, _references(world, cases), timeout_s=600), world)


def test_wallfacer_p16_c4():
    """P = 16: C = 4 and 2; Llama-3-8B heads (32/8, d = 128, bf16) with C = 4 send no more bytes per rank than
    ring (C = 1) over the same 16 ranks, counted (forward + backward, every rank)."""
    llama = dict(causal=True, hq=32, hk=8, d=128, dtype=torch.bfloat16, sharding="zigzag")
    cases = [dict(c=4, causal=True, hq=4, hk=2, d=64, dtype=torch.float32, sharding="zigzag"),
             dict(c=2, causal=True, hq=4, hk=2, d=64, dtype=torch.bfloat16, sharding="zigzag"),
             dict(c=4, causal=True, hq=8, hk=2, d=64, dtype=torch.bfloat16, sharding="zigzag"),
             dict(c=4, **llama), dict(c=1, **llama)]
    results = run_distributed(_run_cases, 16, cases, _references(16, cases), timeout_s=600)
    _check(results, 16)
    sent = [[sum(sum(kinds.values()) for kinds in r[i]["bytes"].values()) for r in results] for i in (3, 4)]
    assert max(sent[0]) <= max(sent[1]), f"multi-ring {max(sent[0])} > ring {max(sent[1])} bytes per rank"


def _bad_inputs(rank, world):
    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.comm import RankLayout, build_groups

    attn = WallFacerAttention(build_groups([RankLayout(tuple(range(world)), 2)]), kernel="cpu_flash")
    mk = lambda s, h=2, dt=torch.float32: torch.randn(1, h, s, 16, dtype=dt)  # noqa: E731
    messages = []
    bad_cases = [
        # (q, k, v) per rank: one rank differs from the others
        lambda: (mk(8), mk(8), mk(8)) if rank != 1 else (mk(12), mk(12), mk(12)),  # sequence length
        lambda: (mk(8), mk(8), mk(8)) if rank != 2 else tuple(mk(8, dt=torch.bfloat16) for _ in range(3)),  # dtype
        lambda: (mk(8), mk(8), mk(8)) if rank != 3 else (mk(7), mk(7), mk(7)),  # odd local length
        lambda: (mk(8, h=3), mk(8), mk(8)),  # heads not a multiple of kv heads, on every rank
    ]
    for make in bad_cases:
        try:
            attn(*make(), causal=True)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    out = attn(mk(8), mk(8), mk(8), causal=True)  # the group is still usable afterwards
    messages.append(tuple(out.shape))
    return messages


def test_bad_input_is_a_clear_error_on_every_rank():
    res = run_distributed(_bad_inputs, 4, timeout_s=120)
    for rank, msgs in enumerate(res):
        assert "local seq len differs across sequence-parallel ranks: [8, 12, 8, 8]" in msgs[0]
        assert "dtype differs" in msgs[1] and "torch.bfloat16" in msgs[1]
        if rank == 3:
            assert "local sequence length 7 is odd" in msgs[2] and "divisible by 2P" in msgs[2]
        else:
            assert "rank(s) [3] rejected their inputs" in msgs[2]
        assert "query heads (3) must be a multiple of kv heads (2)" in msgs[3]
        assert msgs[4] == (1, 2, 8, 16)
