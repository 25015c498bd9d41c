"""The longest sequence one GPU trains, by the planner's memory model, beside DeepSpeed ALST's published figures.

For each GPU preset and offload recipe (nothing offloaded; the optimizer; + checkpointed layer inputs; + ZeRO-3
parameters) the longest length any configuration fits (``planner.max_seq_len``, bisection over the memory model),
the configuration the planner would run there and its memory breakdown. The memory model is checked against measured
steps on CPU (tests/planner/test_memory_measured.py); on a GPU the measured peak of a real step at the predicted
length is the check (``benchmarks/bench_memory.py --device cuda``), not run here.

  python benchmarks/max_length.py                                   # Llama-3-8B on h200x1 and h100x1, ZeRO-3
  python benchmarks/max_length.py --model llama3-8b --cluster h200x1 --json-only
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from harness import add_out_option, emit, plot_path, print_table, save_plot  # first: the repository on sys.path

from ds_wallfacer.planner import Workload, get_cluster, get_model, max_seq_len, memory_breakdown, plan
from ds_wallfacer.planner.memory import GIB

ALST = {("llama3-8b", "h200x1"): 1_200_000, ("llama3-8b", "h100x1"): 500_000}
"""DeepSpeed ALST's published longest Llama-3.1-8B sequence on one GPU (all its offloads on)."""

RECIPES = (
    ("none", {}),
    ("optimizer", {"offload_optimizer": True}),
    ("optimizer+checkpoints", {"offload_optimizer": True, "offload_checkpoints": True}),
    ("optimizer+checkpoints+params", {"offload_optimizer": True, "offload_checkpoints": True, "offload_params": True}),
)


def _row(model_name: str, cluster_name: str, recipe: str, offloads: dict) -> dict:
    model, cluster = get_model(model_name), get_cluster(cluster_name)
    workload = Workload(seq_len=2, zero_stage=3, **offloads)
    n = max_seq_len(model, cluster, workload)
    out = {"model": model_name, "cluster": cluster_name, "offload": recipe, "max_seq_len": n,
           "alst_seq_len": ALST.get((model_name, cluster_name)) if "params" in recipe else None}
    if n:
        cand = plan(cluster, model, n, workload=workload).choice.candidate
        mem = memory_breakdown(model, cluster, cand, replace(workload, seq_len=n))
        out.update(config=cand.label, device_gib=mem.total / GIB, host_gib=mem.host / GIB, breakdown=mem.describe())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--cluster", action="append", help="GPU preset (repeatable; default h200x1 and h100x1)")
    ap.add_argument("--json-only", action="store_true")
    add_out_option(ap, "max_length")
    args = ap.parse_args()
    clusters = args.cluster or ["h200x1", "h100x1"]
    rows = [_row(args.model, c, name, off) for c in clusters for name, off in RECIPES]
    if not args.json_only:
        print_table(
            [("cluster", "<"), ("offload", "<"), ("max tokens", ",d"), ("ALST", ",d"), ("ours / ALST", ".2f"),
             ("configuration", "<"), ("device GiB", ".1f"), ("host GiB", ".1f")],
            [(r["cluster"], r["offload"], r["max_seq_len"], r["alst_seq_len"],
              r["max_seq_len"] / r["alst_seq_len"] if r["alst_seq_len"] else None, r.get("config"),
              r.get("device_gib"), r.get("host_gib")) for r in rows],
            title=f"{args.model}: longest sequence on one GPU by the memory model (ZeRO-3, MsT, lean norms)")
        for r in rows:
            if r.get("breakdown"):
                print(f"  {r['cluster']} {r['offload']} at {r['max_seq_len']:,}: {r['breakdown']}")

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 3.5))
        for c in clusters:
            mine = [r for r in rows if r["cluster"] == c]
            ax.plot([r["offload"] for r in mine], [r["max_seq_len"] / 1e6 for r in mine], marker="o", label=c)
            if (args.model, c) in ALST:
                ax.axhline(ALST[(args.model, c)] / 1e6, linestyle=":", label=f"ALST {c}")
        ax.set_ylabel("max tokens (M)")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)
        fig.tight_layout()
        return fig

    args.out.mkdir(parents=True, exist_ok=True)
    save_plot(plot_path(args, "max_length.png"), draw)
    emit({"rows": rows}, args.out / "max_length.json",
         line={"max_seq_len": {f"{r['cluster']}/{r['offload']}": r["max_seq_len"] for r in rows}})


if __name__ == "__main__":
    main()
