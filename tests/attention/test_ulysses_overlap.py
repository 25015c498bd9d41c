"""Ulysses in head groups (``attention/ulysses_overlap.py``): the same results as one all-to-all each way, bit for
bit, with the same bytes; the float64 reference agrees; under layer checkpointing it runs once; and only the first
group's all-to-all in and the last group's out are exposed (Note [Ulysses in head groups]). 4 gloo ranks, U = 4."""
from __future__ import annotations

import torch

from tests.attention.reference import full_inputs, reference_attention
from tests.dist_utils import run_distributed

N = 64
CASES = {
    # name: (q heads, kv heads, head dim, v head dim, dtype, head groups, options)
    "mha": (8, 8, 16, 16, torch.float32, 2, {}),
    "gqa+sinks+mla-v": (16, 8, 16, 24, torch.float32, 2, {"sinks": True}),
    "4 groups": (16, 16, 16, 16, torch.float32, 4, {}),
    "documents+window+softcap": (8, 8, 16, 16, torch.float32, 2, {"docs": (0, 11, 40), "window": 9, "softcap": 5.0}),
    "bf16 gqa": (16, 8, 16, 16, torch.bfloat16, 2, {}),
}


def _run(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from ds_wallfacer.attention.documents import BatchDocuments, SequenceBatch
    from ds_wallfacer.attention.residuals import KeepAttention
    from ds_wallfacer.attention.ulysses import LocalAttention, UlyssesAttention
    from ds_wallfacer.comm import CommLayer, exposed
    from ds_wallfacer.data import shard_sequence

    sh = lambda x: shard_sequence(x, dim=2, index=rank, sp_size=world, ulysses_degree=world,  # noqa: E731
                                  scheme="zigzag").contiguous()
    out = {}
    for name, (hq, hk, d, dv, dtype, groups, opts) in CASES.items():
        q, k, v, do = full_inputs(batch=1, q_heads=hq, kv_heads=hk, seq_len=N, head_dim=d, dtype=dtype, value_dim=dv)
        sinks = torch.linspace(-1.0, 1.0, hq, dtype=dtype) if opts.get("sinks") else None
        batch = (SequenceBatch(documents=BatchDocuments(starts=(opts["docs"],), seq_len=N)) if "docs" in opts
                 else None)
        kw = dict(causal=True, batch=batch, window=opts.get("window"), softcap=opts.get("softcap", 0.0))
        res = {}
        for k_groups in (1, groups):
            comm = CommLayer(device="cpu")
            attn = UlyssesAttention(dist.group.WORLD, LocalAttention("auto"), comm=comm, head_groups=k_groups)
            attn(sh(q), sh(k), sh(v), **kw)  # the input check's one-time all-gather, outside what is compared
            comm.reset()
            leaves = [sh(x).requires_grad_() for x in (q, k, v)]
            s_leaf = None if sinks is None else sinks.clone().requires_grad_()
            with comm.recording() as timeline:
                o = attn(*leaves, **kw, sinks=s_leaf)
                o.backward(sh(do))
            grads = [x.grad for x in leaves] + ([] if s_leaf is None else [s_leaf.grad])
            res[k_groups] = dict(tensors=[o.detach()] + grads, sent=dict(comm.sent),
                                 exposed=exposed(timeline), hidden=sum(r.hidden for r in timeline))
        # under layer checkpointing that keeps attention: one kept op, replayed, the same gradients
        comm = CommLayer(device="cpu")
        attn = UlyssesAttention(dist.group.WORLD, LocalAttention("auto"), comm=comm, head_groups=groups)
        attn(sh(q), sh(k), sh(v), **kw)
        ckpt = KeepAttention(lambda fn, *a: torch.utils.checkpoint.checkpoint(fn, *a, use_reentrant=False))
        leaves = [sh(x).requires_grad_() for x in (q, k, v)]
        leaves += [] if sinks is None else [sinks.clone().requires_grad_()]
        o = ckpt(lambda *xs: attn(*xs[:3], **kw, sinks=xs[3] if len(xs) > 3 else None) * 1.0, *leaves)
        o.backward(sh(do))
        res["checkpointed"] = dict(tensors=[o.detach()] + [x.grad for x in leaves], stats=ckpt.stats.as_dict())
        # the float64 reference (fp32 cases)
        if dtype == torch.float32:
            keep = None
            if batch is not None:
                from tests.attention.reference import document_mask

                starts = opts["docs"]
                lengths = [b - a for a, b in zip(starts, (*starts[1:], N))]
                keep = document_mask([lengths], window=opts.get("window"))
            ref = reference_attention(q, k, v, do, causal=True, keep=keep, softcap=opts.get("softcap", 0.0),
                                      sinks=sinks)
            got = res[groups]["tensors"]
            mine = slice(rank * hq // world, (rank + 1) * hq // world)  # a rank's sink gradient: its heads' rows
            res["ref_err"] = [(g.double() - sh(r).double()).abs().max().item() if r.dim() == 4 else
                              (g[mine].double() - r[mine].double()).abs().max().item() for g, r in zip(got, ref)]
        out[name] = res
    return out


def test_head_groups_match_one_all_to_all_exactly() -> None:
    for rank, res in enumerate(run_distributed(_run, 4, timeout_s=300)):
        for name, (hq, hk, d, dv, dtype, groups, opts) in CASES.items():
            r = res[name]
            one, many = r[1], r[groups]
            where = f"rank {rank} {name}"
            for i, (a, b) in enumerate(zip(one["tensors"], many["tensors"])):
                assert torch.equal(a, b), f"{where}: result {i} differs between 1 and {groups} head groups"
            assert one["sent"] == many["sent"], f"{where}: bytes {many['sent']} != {one['sent']}"
            # exposed: the first group's all-to-all in and the last group's out, in each phase; the rest hidden
            want = [(ph, "all_to_all") for ph in ("forward", "forward", "backward", "backward")]
            assert many["exposed"] == want, f"{where}: exposed {many['exposed']}"
            assert many["hidden"] == 2 * 2 * (groups - 1), f"{where}: {many['hidden']} hidden"
            assert one["hidden"] == 0, where
            ck = r["checkpointed"]
            for i, (a, b) in enumerate(zip(ck["tensors"], many["tensors"])):
                assert torch.equal(a, b), f"{where}: checkpointed result {i} differs"
            s = ck["stats"]
            assert (s["stored"], s["replayed"], s["missed"], s["kept_bytes"]) == (1, 1, 0, 0), f"{where}: {s}"
            if dtype == torch.float32:
                assert max(r["ref_err"]) < 2e-5, f"{where}: errors against float64 {r['ref_err']}"
