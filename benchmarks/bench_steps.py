"""Work-balanced steps: per round of micro-batches, the busiest data-parallel replica's attention work (and time)
over the mean replica's, in an epoch's shuffled order against ``balanced_order`` (the trainer's
``--balance_steps``, the loader's ``balance_steps``).

    python benchmarks/bench_steps.py                          # about 2 minutes
    python benchmarks/bench_steps.py --replicas 4,8,16 --time-rounds 32

Part 1 (work, pure): an epoch of rows of 8K, 32K and 128K tokens (4096, 2048 and 1024 rows), packed in order from
log-normal documents (sigma 1.5) with median 2048 tokens ("short": bench_balance's mix) or median N / 8 ("long"),
the document that does not fit cut at the row end; one row per micro-batch, D replicas. Work of a row = its
documents' causal score entries. Per order: mean and worst round, the share of rounds within 5 %, and the idle
share: the replicas' attention time spent waiting for the busiest of their round, over the epoch, if time were work
(the worst rounds of a balanced order are light ones, so they cost little).

Part 2 (time, measured): the first ``--time-rounds`` rounds of each order at 8K (``--time-seq-len``; short mix,
D = 4): every row's attention forward + backward on this process (``cpu_flash``, fp32, 4 heads of 32, one varlen
call per block of documents), each replica's time summed per round. Replicas wait for the slowest at every round (ZeRO reduces each
micro-batch's gradients), so the busiest replica's time over the mean is the share of the step the others idle.

Prints the tables, writes ``runs/bench/steps/`` (``--out``: result.json, plot.png) and ends with a JSON line.
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import add_out_option, emit, plot_path, print_table, save_plot  # first: the repository on sys.path

from document_mix import lognormal_document_mix
from ds_wallfacer.data.steps import balanced_order, idle_share, round_balance, row_work

TARGET = 1.05
LENGTHS = {8192: 4096, 32768: 2048, 131072: 1024}
"""Row length -> rows in the epoch."""
WINDOW = 64
"""Rounds per window of the windowed variant."""


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _epoch(seq_len: int, rows: int, mix: str) -> list[list[int]]:
    median = 2048 if mix == "short" else seq_len // 8
    return lognormal_document_mix(seed=seq_len + rows, rows=rows, seq_len=seq_len, median=median, max_len=1 << 24)


def _orders(work: list[int], replicas: int) -> dict[str, list[int]]:
    return {
        "shuffled": list(range(len(work))),  # the epoch's rows arrive in random order already
        "balanced": balanced_order(work, per_replica=1, replicas=replicas, seed=0),
        f"balanced, {WINDOW}-round windows": balanced_order(work, per_replica=1, replicas=replicas, seed=0,
                                                            window=WINDOW),
    }


def _summary(ratios: list[float], idle: float) -> dict:
    return {"mean": statistics.mean(ratios), "worst": max(ratios),
            "within_5pct": sum(r <= TARGET for r in ratios) / len(ratios), "idle_share": idle}


def work_table(replicas: list[int]) -> list[dict]:
    out = []
    for seq_len, rows in LENGTHS.items():
        for mix in ("short", "long"):
            epoch = _epoch(seq_len, rows, mix)
            work = [row_work(r) for r in epoch]
            docs = statistics.median(len(r) for r in epoch)
            for d in replicas:
                for name, order in _orders(work, d).items():
                    ratios = round_balance(work, order, per_replica=1, replicas=d)
                    idle = idle_share(work, order, per_replica=1, replicas=d)
                    out.append({"seq_len": seq_len, "mix": mix, "docs_per_row": docs, "replicas": d, "order": name,
                                **_summary(ratios, idle)})
    return out


def _row_seconds(docs: list[int], heads: int, dim: int, repeats: int) -> float:
    import torch

    from ds_wallfacer.attention.documents import BatchDocuments, SequenceBatch
    from ds_wallfacer.attention.kernels import get_kernel
    from ds_wallfacer.attention.local import local_backward, local_calls, local_forward

    n = sum(docs)
    starts = tuple(sum(docs[:i]) for i in range(len(docs)))
    batch = SequenceBatch(documents=BatchDocuments(starts=(starts,), seq_len=n))
    calls = local_calls(1, n, True, batch, None)
    kernel = get_kernel("cpu_flash")
    g = torch.Generator().manual_seed(len(docs))
    q, k, v, dout = (torch.randn(1, heads, n, dim, generator=g) for _ in range(4))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        out, lse = local_forward(q, k, v, None, kernel, True, dim ** -0.5, calls, None, 0.0)
        local_backward(dout, q, k, v, out, lse, kernel, True, dim ** -0.5, calls, None, 0.0)
        best = min(best, time.perf_counter() - t0)
    return best


def time_table(rounds: int, repeats: int, seq_len: int = 8192) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    replicas = 4
    epoch = _epoch(seq_len, LENGTHS.get(seq_len, 8192), "short")
    work = [row_work(r) for r in epoch]
    out = []
    cache: dict[int, float] = {}
    for name, order in list(_orders(work, replicas).items())[:2]:
        ratios, work_ratios = [], []
        for a in range(0, rounds * replicas, replicas):
            rows = order[a : a + replicas]
            secs = [cache.setdefault(r, _row_seconds(epoch[r], 4, 32, repeats)) for r in rows]
            ratios.append(max(secs) / statistics.mean(secs))
            work_ratios.append(round_balance(work, rows, per_replica=1, replicas=replicas)[0])
        out.append({"seq_len": seq_len, "replicas": replicas, "order": name, "rounds": rounds,
                    "work_mean": statistics.mean(work_ratios), "time_mean": statistics.mean(ratios),
                    "time_worst": max(ratios), "idle_share": 1 - 1 / statistics.mean(ratios)})
    return out


def _draw(rows: list[dict], plt):
    fig, ax = plt.subplots(figsize=(7.0, 4.2))
    keys = [(r["seq_len"], r["mix"]) for r in rows if r["order"] == "shuffled" and r["replicas"] == rows[0]["replicas"]]
    labels = [f"{n // 1024}K {mix}" for n, mix in keys]
    width = 0.27
    for j, order in enumerate(dict.fromkeys(r["order"] for r in rows)):
        vals = [next(r["mean"] for r in rows if (r["seq_len"], r["mix"]) == key and r["order"] == order
                     and r["replicas"] == rows[0]["replicas"]) for key in keys]
        ax.bar([i + (j - 1) * width for i in range(len(keys))], vals, width, label=order)
    ax.axhline(TARGET, color="grey", lw=0.8)
    ax.set_xticks(range(len(keys)), labels)
    ax.set_ylabel("busiest replica's attention work / mean (mean round)")
    ax.set_title(f"rounds of {rows[0]['replicas']} data-parallel replicas, one row each")
    ax.set_ylim(bottom=0.9)
    ax.legend(fontsize=8)
    return fig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--replicas", type=_ints, default=[4, 8], help="comma list of data-parallel replica counts D")
    ap.add_argument("--time-rounds", type=int, default=12, help="rounds timed per order in part 2 (0: skip)")
    ap.add_argument("--repeats", type=int, default=2, help="timings per row in part 2 (the fastest counts)")
    ap.add_argument("--time-seq-len", type=int, default=8192, choices=sorted(LENGTHS) + [2048],
                    help="row length of part 2's epoch (2048: 8192 rows, a quick check)")
    add_out_option(ap, "steps")
    args = ap.parse_args()
    work = work_table(args.replicas)
    print_table([("N", "d"), ("mix", "<"), ("docs/row", ".0f"), ("D", "d"), ("order", "<"), ("mean", ".3f"),
                 ("worst", ".3f"), ("rounds <= 1.05", ".1%"), ("idle share", ".2%")],
                [[r["seq_len"], r["mix"], r["docs_per_row"], r["replicas"], r["order"], r["mean"], r["worst"],
                  r["within_5pct"], r["idle_share"]] for r in work],
                title="attention work per round: busiest replica / mean replica")
    timed = time_table(args.time_rounds, args.repeats, args.time_seq_len) if args.time_rounds else []
    if timed:
        print()
        print_table([("N", "d"), ("D", "d"), ("order", "<"), ("rounds", "d"), ("work mean", ".3f"),
                     ("time mean", ".3f"), ("time worst", ".3f"), ("idle share", ".0%")],
                    [[r["seq_len"], r["replicas"], r["order"], r["rounds"], r["work_mean"], r["time_mean"],
                      r["time_worst"], r["idle_share"]] for r in timed],
                    title="measured attention fwd+bwd per round (cpu_flash, fp32): busiest replica / mean replica")
    save_plot(plot_path(args), lambda plt: _draw(work, plt))
    rnd = lambda r: {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}  # noqa: E731
    emit({"bench": "steps", "target": TARGET, "work": [rnd(r) for r in work], "time": [rnd(r) for r in timed]},
         args.out / "result.json")


if __name__ == "__main__":
    main()
