"""Packed documents under ring / WallFacer attention: work balance and time of dense causal, packed with zigzag
sharding, and packed with balanced sharding, on the same inputs.

    python benchmarks/bench_packed.py                       # 4 CPU ranks (gloo), 8K tokens
    python benchmarks/bench_packed.py --ranks 8 --seq-len 16384 --ring-count 2

Documents are log-normal lengths (median N/64, clipped to [N/512, N/2]) packed into one N-token row, the mix
of ``data.balance.lognormal_document_mix`` scaled to N. Per method it prints the attention work per rank
(score entries the kernels compute: max/mean is the balance figure; packed methods compute no pair across
documents) and the median fwd+bwd time over the slowest rank. Work is deterministic; times on a shared CPU are
noisy, so compare the methods of one run. The last line is one JSON object, also written to
``runs/bench/packed/result.json`` (``--out``) beside the plot.
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import add_out_option, emit, plot_path, print_table, run_ranks, save_plot  # first: repository on path

import torch
import torch.distributed as dist

METHODS = ("dense causal", "packed, zigzag", "packed, balanced")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="P, sequence-parallel ranks (spawned gloo processes)")
    ap.add_argument("--ring-count", type=int, default=1, help="C (C*C must divide P)")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--chunks-per-rank", type=int, default=8, help="balanced sharding: chunks per rank")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    add_out_option(ap, "packed")
    return ap.parse_args()


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from ds_wallfacer.attention.documents import BatchDocuments, SequenceBatch
    from ds_wallfacer.attention.wallfacer import WallFacerAttention
    from ds_wallfacer.comm import RankLayout, build_groups
    from ds_wallfacer.data.balance import balanced_assignment, lognormal_document_mix
    from ds_wallfacer.data.pieces import shard_sequence

    p, n = world, args.seq_len
    lengths = lognormal_document_mix(seed=args.seed, rows=1, seq_len=n, median=n / 64, min_len=max(1, n // 512),
                                     max_len=n // 2)[0]
    starts = [0]
    for x in lengths[:-1]:
        starts.append(starts[-1] + x)
    docs = BatchDocuments(starts=(tuple(starts),), seq_len=n)
    groups = build_groups([RankLayout(tuple(range(p)), args.ring_count)])
    index = groups.place.index
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, do = (torch.randn(1, h, n, args.head_dim, generator=g)
                   for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    balanced = balanced_assignment([lengths], sp_size=p, chunks_per_rank=args.chunks_per_rank)
    plans = [
        (METHODS[0], None, None),
        (METHODS[1], SequenceBatch(documents=docs), None),
        (METHODS[2], SequenceBatch(documents=docs, assignment=balanced), balanced),
    ]
    out = []
    for name, batch, assignment in plans:
        attn = WallFacerAttention(groups, kernel="cpu_flash", sharding="zigzag")
        sh = lambda x: shard_sequence(x, dim=2, index=index, sp_size=p, assignment=assignment).contiguous()  # noqa: E731
        ql, kl, vl, dol = (sh(x) for x in (q, k, v, do))
        times = []
        for it in range(args.iters + 1):
            attn.work.clear()
            a, b, c = (x.clone().requires_grad_() for x in (ql, kl, vl))
            dist.barrier()
            t0 = time.perf_counter()
            attn(a, b, c, causal=True, batch=batch).backward(dol)
            dist.barrier()
            if it:  # the first call builds the schedule and warms up
                times.append(time.perf_counter() - t0)
        out.append(dict(method=name, work=attn.work["forward"], time_s=statistics.median(times),
                        docs=len(lengths)))
    return out


def _draw(rows: list[dict], plt):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.5))
    names = [r["method"] for r in rows]
    a1.bar(names, [r["balance"] for r in rows], color=["grey", "tab:orange", "tab:green"])
    a1.axhline(1.10, ls="--", color="k", lw=0.8)
    a1.set_ylabel("attention work, max/mean over ranks")
    a2.bar(names, [r["time_s"] for r in rows], color=["grey", "tab:orange", "tab:green"])
    a2.set_ylabel("fwd+bwd time, slowest rank (s)")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=7)
    return fig


def main() -> None:
    args = parse()
    per_rank = run_ranks(_measure, args.ranks, args, timeout_s=3600)
    if per_rank is None:  # a launcher's rank other than 0
        return
    rows = []
    for i, name in enumerate(METHODS):
        work = [mine[i]["work"] for mine in per_rank]
        t = max(mine[i]["time_s"] for mine in per_rank)
        rows.append(dict(method=name, balance=max(work) / (sum(work) / len(work)), work_max=max(work), time_s=t))
    for r in rows:
        r["time_vs_dense"] = r["time_s"] / rows[0]["time_s"]
    print_table([("method", "<"), ("work max/mean", ".3f"), ("work (max rank)", ",d"), ("fwd+bwd s", ".3f"),
                 ("vs dense", ".2f")],
                [[r["method"], r["balance"], r["work_max"], r["time_s"], r["time_vs_dense"]] for r in rows],
                title=f"P = {len(per_rank)}, C = {args.ring_count}, N = {args.seq_len}, {per_rank[0][0]['docs']} "
                      f"documents, {args.heads}/{args.kv_heads} heads, d = {args.head_dim}, fp32, cpu_flash")
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit({"bench": "packed", "sp_size": len(per_rank), "ring_count": args.ring_count, "seq_len": args.seq_len,
          "chunks_per_rank": args.chunks_per_rank, "rows": rows}, args.out / "result.json")

if __name__ == "__main__":
    main()
