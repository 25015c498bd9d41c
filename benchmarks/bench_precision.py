"""Error of bf16 WallFacer against float64, as a multiple of the same kernel's error in one process, by the dtype
the summed tensors travel in (wallfacer.py Note [Summed tensors on the wire]).

    python benchmarks/bench_precision.py                          # P = 4, 8, 16; C = 1, 2, 4; 6 seeds
    python benchmarks/bench_precision.py --sp-sizes 4 --seeds 12 --head-dim 128

For each P (one launch of P gloo ranks on this machine) and each valid ring count C, every seed draws unit-scale
q, k, v, dO (bf16, ``--heads`` / ``--kv-heads``, causal, zigzag) and runs WallFacer three ways: the summed tensors
all in fp32, all in the input dtype, and the defaults (``volume.DEFAULT_SUM_DTYPES``). The error of out, dq, dk,
dv is the max abs difference from a float64 attention (PyTorch's SDPA by autograd), over every rank; the floor is
the same block kernel on the whole sequence in one process. Prints, per (P, C, setting), the worst and mean ratio
over the seeds, writes ``runs/bench/precision/`` (``--out``: result.json, and plot.png when matplotlib is
installed) and ends with a JSON line. CPU only (gloo, cpu_flash).
"""
from __future__ import annotations

import argparse

from harness import add_out_option, emit, plot_path, print_table, save_plot, spawn_ranks  # first: repository on path

TENSORS = ("out", "dq", "dk", "dv")
SETTINGS = ("float32", "input", "default")
LIMIT = 2.0
"""A tensor may travel in the input dtype where its error stays within this multiple of the floor."""


def _float64_attention(q, k, v, do):
    """Causal attention and its gradients in float64 by autograd through PyTorch's SDPA: (out, dq, dk, dv)."""
    import torch.nn.functional as F

    rep = q.shape[1] // k.shape[1]
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(do.double())
    return out.detach(), q.grad, k.grad, v.grad


def _run(rank: int, world: int, seeds: list[int], heads: int, kv_heads: int, head_dim: int, seq_per_rank: int):
    import torch

    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.attention.kernels import get_kernel
    from ds_wallfacer.attention.volume import DEFAULT_SUM_DTYPES, SumDtypes
    from ds_wallfacer.comm import RankLayout, build_groups, valid_ring_counts
    from ds_wallfacer.data import shard_sequence

    sums = {"float32": SumDtypes.uniform("float32"), "input": SumDtypes.uniform("input"), "default": DEFAULT_SUM_DTYPES}
    groups = {c: build_groups([RankLayout(tuple(range(world)), c)]) for c in valid_ring_counts(world)}
    n, scale, rows = seq_per_rank * world, head_dim ** -0.5, []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)  # unit-scale, drawn in float64 and rounded: q, k, v, dO
        q, k, v, do = (torch.randn(2, h, n, head_dim, generator=g, dtype=torch.float64).to(torch.bfloat16)
                       for h in (heads, kv_heads, kv_heads, heads))
        truth = _float64_attention(q, k, v, do)
        kern = get_kernel("cpu_flash", q)
        o1, lse1 = kern.forward(q, k, v, causal=True, scale=scale)
        g1 = kern.backward(do, q, k, v, o1, lse1, causal=True, scale=scale)
        single = [(a.double() - b).abs().max().item() for a, b in zip([o1, *g1], truth)]
        sh = lambda x: shard_sequence(x, dim=2, index=rank, sp_size=world)  # noqa: E731
        for c, grp in groups.items():
            for name in SETTINGS:
                attn = WallFacerAttention(grp, kernel="cpu_flash", accum_comm_dtype=sums[name])
                ql, kl, vl = (sh(x).requires_grad_() for x in (q, k, v))
                out = attn(ql, kl, vl, causal=True)
                out.backward(sh(do))
                errs = [(a.double() - sh(b)).abs().max().item() for a, b in zip([out, ql.grad, kl.grad, vl.grad], truth)]
                rows.append(dict(c=c, setting=name, seed=seed, errs=errs, single=single))
    return rows


def _table(per_rank: list[list[dict]], world: int) -> list[dict]:
    """Worst error over ranks per (C, setting, seed), then worst and mean ratio to the floor over seeds."""
    worst: dict[tuple, list] = {}
    for rows in per_rank:
        for r in rows:
            key = (r["c"], r["setting"], r["seed"])
            w = worst.setdefault(key, [[0.0] * 4, r["single"]])
            w[0] = [max(a, b) for a, b in zip(w[0], r["errs"])]
    out: dict[tuple, list] = {}
    for (c, setting, _), (errs, single) in worst.items():
        out.setdefault((c, setting), []).append([e / s for e, s in zip(errs, single)])
    return [dict(sp_size=world, ring_count=c, setting=setting,
                 worst={t: max(r[i] for r in ratios) for i, t in enumerate(TENSORS)},
                 mean={t: sum(r[i] for r in ratios) / len(ratios) for i, t in enumerate(TENSORS)})
            for (c, setting), ratios in sorted(out.items())]


def _draw(rows: list[dict], plt):
    fig, axes = plt.subplots(1, 4, figsize=(13, 3.6), sharey=True)
    labels = sorted({(r["sp_size"], r["ring_count"]) for r in rows})
    for ax, t in zip(axes, TENSORS):
        for j, setting in enumerate(SETTINGS):
            ys = [next(r["worst"][t] for r in rows if (r["sp_size"], r["ring_count"]) == pc and r["setting"] == setting)
                  for pc in labels]
            ax.bar([i + (j - 1) * 0.27 for i in range(len(labels))], ys, width=0.27, label=setting)
        ax.axhline(LIMIT, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(labels)), [f"P={p}\nC={c}" for p, c in labels], fontsize=7)
        ax.set_title(t)
    axes[0].set_ylabel("worst error / single-process error")
    axes[0].legend(fontsize=7)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp-sizes", default="4,8,16", help="P values, one gloo launch each")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--seq-per-rank", type=int, default=16)
    add_out_option(ap, "precision")
    args = ap.parse_args()
    rows: list[dict] = []
    for p in (int(x) for x in args.sp_sizes.split(",")):
        per_rank = spawn_ranks(_run, p, list(range(args.seeds)), args.heads, args.kv_heads, args.head_dim,
                                   args.seq_per_rank, timeout_s=1800)
        rows += _table(per_rank, p)
    print_table([("P", "d"), ("C", "d"), ("summed in", "<"), *((t, "") for t in TENSORS)],
                [[r["sp_size"], r["ring_count"], r["setting"],
                  *(f"{r['worst'][t]:.2f} ({r['mean'][t]:.2f})" for t in TENSORS)] for r in rows],
                title=f"worst (mean) error / single-process error over {args.seeds} seeds; bf16, {args.heads}/"
                      f"{args.kv_heads} heads, d = {args.head_dim}, {args.seq_per_rank} tokens per rank")
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit({"bench": "precision", "seeds": args.seeds, "heads": args.heads, "kv_heads": args.kv_heads,
          "head_dim": args.head_dim, "seq_per_rank": args.seq_per_rank, "limit": LIMIT, "rows": rows},
         args.out / "result.json")


if __name__ == "__main__":
    main()
