"""Attention balance of packed documents: zigzag sharding against the balanced chunk assignment.

    python benchmarks/bench_balance.py                   # 1 and 4 rows; P = 4, 8, 16; 2, 4, 8 chunks per rank
    python benchmarks/bench_balance.py --rows 2 --seeds 32 --sp-sizes 8,32,64 --chunks 4,8,16

Document lengths are log-normal (median 2048, sigma 1.5) clipped to [100, 65536] and packed into rows of
131072 tokens; a batch of ``--rows`` rows shares one assignment (one row per micro-batch is the hardest case:
nothing averages out). Work of a token = keys of its own document it sees (``ds_wallfacer.data.balance``).
Prints a table per row count (P, chunks per rank, zigzag and balanced max/mean as mean and worst over the
seeded batches, assignment time), writes ``runs/bench/balance/`` (``--out``: result.json, and plot.png when
matplotlib is installed) and ends with a JSON line. Pure Python: no torch.
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import add_out_option, emit, plot_path, print_table, save_plot  # first: the repository on sys.path

from ds_wallfacer.data.balance import (
    balance_ratio,
    balanced_assignment,
    rank_work,
    zigzag_assignment,
)
from ds_wallfacer.data.chunks import DEFAULT_CHUNKS_PER_RANK
from document_mix import lognormal_document_mix

TARGET = 1.10


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _draw(rows: list[dict], plt):
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    sps = sorted({r["sp_size"] for r in rows})
    for b, style in zip(sorted({r["rows"] for r in rows}), ("-", ":", "-.", "--")):
        pick = [r for r in rows if r["rows"] == b]
        zig = [next(r["zigzag_worst"] for r in pick if r["sp_size"] == p) for p in sps]
        ax.plot(sps, zig, "k" + style + "o", label=f"zigzag, {b} row(s)")
        for m in sorted({r["chunks_per_rank"] for r in pick}):
            ax.plot(sps, [next(r["balanced_worst"] for r in pick if r["sp_size"] == p and r["chunks_per_rank"] == m)
                          for p in sps], style + "o", label=f"balanced, {m} chunks per rank, {b} row(s)")
    ax.axhline(TARGET, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sps, [str(p) for p in sps])
    ax.set_xlabel("ring ranks P")
    ax.set_ylabel("attention work, busiest rank / mean (worst batch)")
    ax.set_title("packed log-normal documents, 128K-token rows")
    ax.legend(fontsize=7)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sp-sizes", type=_ints, default=[4, 8, 16], help="comma list of ring sizes P")
    ap.add_argument("--chunks", type=_ints, default=[2, 4, 8], help="comma list of chunks per rank")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--rows", type=_ints, default=[1, 4],
                    help="comma list of rows per batch (they share one assignment)")
    ap.add_argument("--seeds", type=int, default=8, help="seeded batches per setting")
    add_out_option(ap, "balance")
    args = ap.parse_args()
    rows, recommended = [], {}
    for n_rows in args.rows:
        batches = [lognormal_document_mix(seed=s, rows=n_rows, seq_len=args.seq_len) for s in range(args.seeds)]
        for p in args.sp_sizes:
            zig = [balance_ratio(rank_work(b, zigzag_assignment(p))) for b in batches]
            for m in args.chunks:
                bal, times = [], []
                for b in batches:
                    t0 = time.perf_counter()
                    a = balanced_assignment(b, sp_size=p, chunks_per_rank=m)
                    times.append(1e3 * (time.perf_counter() - t0))
                    bal.append(balance_ratio(rank_work(b, a)))
                row = dict(rows=n_rows, sp_size=p, chunks_per_rank=m, zigzag_mean=statistics.mean(zig),
                           zigzag_worst=max(zig), balanced_mean=statistics.mean(bal), balanced_worst=max(bal),
                           assign_ms_median=statistics.median(times), assign_ms_max=max(times))
                rows.append(row)
        # the fewest chunks per rank whose worst batch meets the target at every P (fewer: longer kernel calls)
        mine = [r for r in rows if r["rows"] == n_rows]
        meets = [m for m in sorted(args.chunks)
                 if all(r["balanced_worst"] <= TARGET for r in mine if r["chunks_per_rank"] == m)]
        recommended[n_rows] = meets[0] if meets else None
    print_table([("rows", "d"), ("P", "d"), ("chunks", "d"), ("zigzag mean", ".3f"), ("zigzag worst", ".3f"),
                 ("balanced mean", ".4f"), ("balanced worst", ".4f"), ("assign ms", ".2f")],
                [[r["rows"], r["sp_size"], r["chunks_per_rank"], r["zigzag_mean"], r["zigzag_worst"],
                  r["balanced_mean"], r["balanced_worst"], r["assign_ms_median"]] for r in rows])
    docs = [len(row) for s in range(args.seeds) for row in lognormal_document_mix(seed=s, rows=1, seq_len=args.seq_len)]
    print(f"{args.seeds} seeded batches per row count; documents per {args.seq_len}-token row: median "
          f"{statistics.median(docs):.0f}, min {min(docs)}, max {max(docs)}")
    for n_rows, m in recommended.items():
        print(f"{n_rows} row(s): fewest chunks per rank with balanced <= {TARGET} on every batch: {m}")
    print(f"the loader's default chunks per rank: {DEFAULT_CHUNKS_PER_RANK}")
    big = lognormal_document_mix(seed=0, rows=1, seq_len=args.seq_len)
    t0 = time.perf_counter()
    balanced_assignment(big, sp_size=64, chunks_per_rank=16)
    big_ms = 1e3 * (time.perf_counter() - t0)
    print(f"assignment time for P = 64, 16 chunks per rank: {big_ms:.1f} ms")
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit({"bench": "balance", "rows": args.rows, "seeds": args.seeds, "seq_len": args.seq_len, "target": TARGET,
          "recommended_chunks_per_rank": {str(k): v for k, v in recommended.items()},
          "default_chunks_per_rank": DEFAULT_CHUNKS_PER_RANK, "p64_m16_assign_ms": round(big_ms, 2),
          "results": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows]},
         args.out / "result.json")


if __name__ == "__main__":
    main()
