"""Topology planner CLI: which split is best for my cluster, model and sequence length?

    python -m ds_wallfacer.planner --cluster h100x64 --model llama3-8b --seq-len 131072
    python -m ds_wallfacer.planner --cluster h100x64 --model llama3-8b --seq-len 131072 --sp-size 64 --json
    python -m ds_wallfacer.planner --paper          # the paper's worked example and configurations
    python -m ds_wallfacer.planner --cluster h100x8 --model llama3-8b --rl grpo --completion-len 16384,32768

Prints the ranked table (configuration, comm volume per rank, comm / compute / step time, memory per rank,
fits?), the best configuration of every strategy (out-of-memory ones with the reason) and the choice with its
reasons; saves a plot of predicted step time against sequence length per configuration (``--plot``). With
``--json`` it prints one JSON object instead. Every cluster, model and workload field has a flag.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from .candidate import PLACEMENTS, STRATEGIES, Workload
from .cluster import CLUSTERS, get_cluster
from .memory import GIB
from .model import MODELS, ModelSpec, get_model
from .paper import comparisons, speedup_table, worked_example
from .search import Plan, PlanError, plan

__all__ = ["main", "parse_args"]

PLOT_SEQ_LENS = tuple(2**k for k in range(15, 23))  # 32K .. 4M


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ds_wallfacer.planner", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cluster", default="h100x64", help=f"preset: {', '.join(CLUSTERS)}")
    ap.add_argument("--model", default="llama3-8b", help=f"preset ({', '.join(MODELS)}) or an HF config.json path")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--calibrate", action="store_true", help="measure this device's compute (GEMM, attention "
                    "kernel, per-call overhead, optimizer, gloo latency), cache it and print it (planner/calibrate.py)")
    g = ap.add_argument_group("cluster fields (override the preset)")
    g.add_argument("--world-size", type=int)
    g.add_argument("--nodes", type=int)
    g.add_argument("--ranks-per-node", type=int)
    g.add_argument("--intra-bw", type=float, help="GB/s per rank inside a node")
    g.add_argument("--nic-bw", type=float, help="Gb/s of one NIC")
    g.add_argument("--nics-per-node", type=int)
    g.add_argument("--intra-latency-us", type=float)
    g.add_argument("--inter-latency-us", type=float)
    g.add_argument("--mem-gib", type=float, help="device memory per rank")
    g.add_argument("--host-mem-gib", type=float, help="host memory per node for offloaded state (0: unchecked)")
    g.add_argument("--tflops", type=float, help="peak dense bf16 TFLOP/s per rank")
    g.add_argument("--mfu", type=float)
    g = ap.add_argument_group("model fields (override the preset)")
    for f in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "head-dim"):
        g.add_argument(f"--{f}", type=int)
    g = ap.add_argument_group("workload")
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--zero-stage", type=int, default=3, choices=(0, 1, 2, 3))
    g.add_argument("--offload-optimizer", action="store_true")
    g.add_argument("--offload-checkpoints", action="store_true", help="checkpointed layer inputs on the host")
    g.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameters on the host")
    g.add_argument("--no-kv-replication", action="store_true", help="cap Ulysses at the kv-head count")
    g.add_argument("--no-overlap", action="store_true", help="ring hops do not overlap attention compute")
    g = ap.add_argument_group('fixed values (default: "auto", the planner chooses)')
    g.add_argument("--strategy", choices=STRATEGIES,
                   help="only this strategy (ring is WallFacer with C = 1; none is P = 1)")
    g.add_argument("--sp-size", type=int)
    g.add_argument("--ring-count", type=int)
    g.add_argument("--ulysses-degree", type=int)
    g.add_argument("--placement", choices=PLACEMENTS)
    g.add_argument("--mst", choices=("on", "off"))
    g.add_argument("--mlp-chunk-tokens", type=int)
    g.add_argument("--lm-head-chunk-tokens", type=int)
    g.add_argument("--ac", choices=("on", "off"), help="activation checkpointing")
    g.add_argument("--checkpointing", choices=("deepspeed", "torch"),
                   help="layer checkpointing: DeepSpeed's (reentrant) or torch's non-reentrant one")
    g.add_argument("--keep-attention", choices=("on", "off"),
                   help="with checkpointing: keep attention's results for the backward (off: recompute them)")
    g = ap.add_argument_group("reinforcement learning (--rl grpo: a GRPO step's phases, planner/rl.py)")
    g.add_argument("--rl", choices=("grpo",), help="predict an RL step: generation, scoring and training per rank")
    g.add_argument("--completions", type=int, default=64, help="completions a step, all replicas together")
    g.add_argument("--prompt-len", type=int, default=1024)
    g.add_argument("--completion-len", default="16384,32768", help="comma-separated completion lengths")
    g.add_argument("--generation", default="transformers,vllm", help="comma-separated: transformers, vllm")
    g.add_argument("--no-reference", action="store_true", help="beta = 0: no reference scoring")
    g.add_argument("--old-policy", action="store_true", help="score the old policy too (importance sampling)")
    g = ap.add_argument_group("output")
    g.add_argument("--top", type=int, default=12, help="ranked rows to print")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--plot", default="auto", help='PNG path; "auto": results/plan_<cluster>_<model>.png; "none"')
    g.add_argument("--paper", action="store_true", help="the paper's worked example and configurations")
    return ap.parse_args(argv)


def _cluster(a: argparse.Namespace):
    c = get_cluster(a.cluster)
    kw: dict[str, Any] = {}
    for key, flag, scale in (("nodes", "nodes", 1), ("ranks_per_node", "ranks_per_node", 1), ("intra_bw", "intra_bw", 1e9),
                             ("nic_bw", "nic_bw", 1e9 / 8), ("nics_per_node", "nics_per_node", 1),
                             ("intra_latency", "intra_latency_us", 1e-6), ("inter_latency", "inter_latency_us", 1e-6),
                             ("mem_bytes", "mem_gib", GIB), ("host_mem_bytes", "host_mem_gib", GIB),
                             ("flops", "tflops", 1e12), ("mfu", "mfu", 1)):
        value = getattr(a, flag)
        if value is not None:
            kw[key] = value * scale if scale != 1 else value
    c = replace(c, **kw) if kw else c
    return c.with_world_size(a.world_size) if a.world_size else c


def _model(a: argparse.Namespace) -> ModelSpec:
    if a.model in MODELS:
        m = get_model(a.model)
    else:
        path = Path(a.model)
        if not path.is_file():
            raise SystemExit(f"--model {a.model!r}: not a preset ({', '.join(MODELS)}) and not a config.json file")
        m = ModelSpec.from_hf_config(json.loads(path.read_text()), name=path.parent.name or path.stem)
    kw = {k.replace("-", "_"): getattr(a, k.replace("-", "_")) for k in
          ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "head-dim")}
    kw = {k: v for k, v in kw.items() if v is not None}
    return replace(m, **kw) if kw else m


def _workload(a: argparse.Namespace, seq_len: int) -> Workload:
    return Workload(seq_len=seq_len, batch=a.batch, zero_stage=a.zero_stage, offload_optimizer=a.offload_optimizer,
                    offload_checkpoints=a.offload_checkpoints, kv_replication=not a.no_kv_replication,
                    overlap=not a.no_overlap, offload_params=a.offload_params)


def _fixed(a: argparse.Namespace) -> dict[str, Any]:
    onoff = {"on": True, "off": False, None: None}
    return {k: v for k, v in {
        "mode": a.strategy, "sp_size": a.sp_size, "ring_count": a.ring_count, "ulysses_degree": a.ulysses_degree,
        "placement": a.placement, "mini_sequence": onoff[a.mst], "mlp_chunk_tokens": a.mlp_chunk_tokens,
        "lm_head_chunk_tokens": a.lm_head_chunk_tokens, "activation_checkpointing": onoff[a.ac],
        "keep_attention": onoff[a.keep_attention],
        "reentrant": {"deepspeed": True, "torch": False, None: None}[a.checkpointing],
    }.items() if v is not None}


# -- printing --------------------------------------------------------------------------------------------

_HEAD = f"{'#':>3} {'configuration':44} {'comm/step':>10} {'comm s':>8} {'compute s':>9} {'step s':>8} " \
        f"{'tokens/s':>10} {'mem GiB':>8}  fits  links"


def _line(i: Any, row) -> str:
    k, m = row.cost, row.memory
    fits = "yes" if row.fits else "OOM"
    return (f"{i:>3} {row.candidate.label:44} {k.step_bytes / GIB:8.2f}Gi {k.comm_s:8.3f} {k.compute_s:9.3f} "
            f"{k.step_s:8.3f} {k.tokens_per_s:10,.0f} {m.total / GIB:8.1f}  {fits:4}  {k.links.describe()}")


def print_plan(pl: Plan, *, top: int) -> None:
    c, w = pl.cluster, pl.workload
    print(f"cluster {c.name}: {c.nodes} node(s) x {c.ranks_per_node} ranks, intra {c.intra_bw / 1e9:.0f} GB/s, "
          f"{c.nics_per_node} x {c.nic_bw * 8 / 1e9:.0f} Gb/s NIC per node, {c.mem_bytes / GIB:.0f} GiB, "
          f"{c.flops / 1e12:.0f} TFLOP/s x MFU {c.mfu}")
    m = pl.model
    print(f"model {m.name}: {m.layers} layers, hidden {m.hidden}, heads {m.heads}/{m.kv_heads} kv, intermediate "
          f"{m.intermediate}, vocab {m.vocab}, {m.params / 1e9:.2f}B params")
    print(f"workload: seq_len {w.seq_len}, batch {w.batch}/SP group, ZeRO-{w.zero_stage}, overlap {w.overlap}; "
          "comm/step = attention bytes sent per rank per step; times per step (one micro-batch per SP group)")
    print(_HEAD)
    fitting = [r for r in pl.rows if r.fits]
    for i, row in enumerate(fitting[:top], 1):
        print(_line(i, row))
    print(f"... {len(fitting)} fitting, {len(pl.rows) - len(fitting)} out of memory")
    print("best of each strategy (where one runs out of memory, its leanest configuration and why):")
    seen: set[str] = set()
    for row in pl.rows:
        if row.candidate.strategy not in seen:
            seen.add(row.candidate.strategy)
            print(_line("", row) + (f"\n      {row.reason}" if row.reason else ""))
    for s in pl.skipped:
        print(f"  not valid: {s}")
    ch = pl.choice
    print(f"\nchoice: {ch.candidate.label}  (config mode={ch.mode} sequence_parallel_size={ch.sp_size} "
          f"ring_count={ch.ring_count} ulysses_degree={ch.ulysses_degree} placement={ch.placement}, "
          f"data parallel {ch.dp_size})")
    for r in ch.reasons:
        print(f"  - {r}")


def print_paper(rows: list[dict[str, Any]], example: dict[str, float]) -> None:
    print("paper worked example: Llama-30B (hidden 6656, 52 heads), N = 65,536, P = 64, C = 4, bf16, B = 1;")
    print("forward bytes per GPU per layer, GiB (2^30 bytes; the paper's 'GB' are GiB)")
    print(f"  {'':34} {'ring':>8} {'WF collective':>14} {'WF ring':>8} {'WF skew':>8} {'WF total':>9}")
    e = {k: v / GIB for k, v in example.items()}
    print(f"  {'paper, as printed (P, P/C^2 hops)':34} {e['ring_printed']:8.3f} {e['collective_printed']:14.3f} "
          f"{e['wf_ring_printed']:8.3f} {'-':>8} {e['collective_printed'] + e['wf_ring_printed']:9.3f}")
    print(f"  {'paper formulas (P-1, P/C^2-1 hops)':34} {e['ring_formula']:8.3f} {e['collective_formula']:14.3f} "
          f"{e['wf_ring_formula']:8.3f} {'-':>8} {e['collective_formula'] + e['wf_ring_formula']:9.3f}")
    print(f"  {'this implementation (busiest rank)':34} {e['impl_ring']:8.3f} {e['impl_collective']:14.3f} "
          f"{e['impl_wf_ring']:8.3f} {e['impl_skew']:8.3f} "
          f"{e['impl_collective'] + e['impl_wf_ring'] + e['impl_skew']:9.3f}")
    print("  (implementation: q + fp32 lse all-gathered in the team, k/v by the skewed gather (skew), fp32 partial"
          " outputs reduce-scattered)")
    print("\npredicted step time (s) and speedup over ring, SP group of P ranks, MsT + checkpointing, ZeRO-3:")
    for r in rows:
        head = f"{r['cluster']} {r['model']} P={r['sp_size']} N={r['seq_len']} overlap={r.get('overlap')}"
        if "error" in r:
            print(f"  {head}: {r['error'].splitlines()[0]}")
            continue
        fams = sorted(r["families"].items(), key=lambda kv: kv[1]["step_s"])
        cells = [f"{f} {d['step_s']:.2f}" + (f" (x{d['speedup_vs_ring']:.2f})" if d["speedup_vs_ring"] else " OOM")
                 for f, d in fams]
        print(f"  {head}\n    " + " | ".join(cells) + f"\n    best: {r['best']}")
        caps = [s for s in r["skipped"] if s.startswith("Ulysses")]
        if caps:
            print("    head caps: " + "; ".join(caps[:3]))


def print_speedups(rows: list[dict[str, Any]]) -> None:
    """The paper table: predicted multi-ring speedup over ring per setting against the paper's best published."""
    print(f"\npredicted multi-ring speedup over ring (whole step; attention alone) vs the paper's best published "
          f"gain on GPT-style models (x{rows[0]['paper_best_speedup']:.2f}, +77.12 %):" if rows else "")
    for r in rows:
        print(f"  {r['cluster']:12} {r['model']:15} P={r['sp_size']:<3} N={r['seq_len']:<7} {r['best_multi_ring']:14} "
              f"x{r['predicted_speedup']:.2f} (attention x{r['predicted_attention_speedup']:.2f}) "
              f"/ paper x{r['paper_best_speedup']:.2f} = {r['ratio_to_paper']:.2f}; ring exposed comm "
              f"{r['ring_exposed_share']:.0%} at {r['tokens_per_rank']} tokens/rank: {r['explanation']}")


def plot(cluster, model, args: argparse.Namespace, sp_size: int, path: Path) -> Path:
    """Predicted step time against sequence length, best row per (strategy, C, U) at SP size ``sp_size``;
    hollow markers: out of memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[tuple[int, float, bool]]] = {}
    for n in PLOT_SEQ_LENS:
        try:
            pl = plan(cluster, model, n, fixed={**_fixed(args), "sp_size": sp_size}, workload=_workload(args, n))
        except PlanError:
            continue
        seen: set[str] = set()
        for row in pl.rows:
            c = row.candidate
            key = f"{c.strategy} C={c.ring_count} U={c.ulysses_degree}"
            if key not in seen:
                seen.add(key)
                series.setdefault(key, []).append((n, row.cost.step_s, row.fits))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, pts in sorted(series.items()):
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        line, = ax.plot(xs, ys, label=key, lw=1.2)
        oom = [(x, y) for x, y, f in pts if not f]
        if oom:
            ax.scatter(*zip(*oom), facecolors="none", edgecolors=line.get_color(), s=30)
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="predicted step time (s)",
           title=f"{model.name} on {cluster.name} ({cluster.world_size} ranks), SP size {sp_size}; hollow = OOM")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out: dict[str, Any] = {}
    if args.calibrate:
        from .calibrate import main as calibrate_main

        import torch

        return calibrate_main(["--force", "--device", "cuda" if torch.cuda.is_available() else "cpu"])
    if args.paper:
        out["paper"] = {"worked_example": worked_example(), "comparisons": comparisons(),
                        "comparisons_no_overlap": comparisons(overlap=False)}
        out["paper"]["speedup_table"] = speedup_table(out["paper"]["comparisons"])
        if not args.json:
            print_paper(out["paper"]["comparisons"], out["paper"]["worked_example"])
            print_speedups(out["paper"]["speedup_table"])
            print("\nwithout overlap of ring hops and attention:")
            print_paper(out["paper"]["comparisons_no_overlap"], out["paper"]["worked_example"])
            return 0
    cluster, model = _cluster(args), _model(args)
    if args.rl:
        return rl_main(args, cluster, model)
    try:
        pl = plan(cluster, model, args.seq_len, fixed=_fixed(args), workload=_workload(args, args.seq_len))
    except PlanError as e:
        if args.json:
            print(json.dumps({**out, "error": str(e), "suggestions": list(e.suggestions)}))
        else:
            print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plot != "none":
        path = Path(args.plot if args.plot != "auto" else f"results/plan_{cluster.name}_{model.name}.png")
        out["plot"] = str(plot(cluster, model, args, pl.choice.sp_size, path))
    if args.json:
        print(json.dumps({**out, **pl.as_dict()}, default=str))
    else:
        print_plan(pl, top=args.top)
        if "plot" in out:
            print(f"\nplot: {out['plot']}")
    return 0


def rl_main(args: argparse.Namespace, cluster, model: ModelSpec) -> int:
    """``--rl grpo``: per completion length and generation backend, the training plan's choice and the step's
    phases per rank (split generation, and redundant with transformers)."""
    from .rl import Rollout, plan_rl

    out: list[dict[str, Any]] = []
    for length in (int(x) for x in args.completion_len.split(",") if x.strip()):
        for backend in (b.strip() for b in args.generation.split(",") if b.strip()):
            rollout = Rollout(completions=args.completions, prompt_len=args.prompt_len, completion_len=length,
                              backend=backend, reference=not args.no_reference, old_policy=args.old_policy)
            try:
                pl, phases = plan_rl(cluster, model, rollout, fixed=_fixed(args),
                                     workload=_workload(args, rollout.seq_len))
            except PlanError as e:
                out.append({"completion_len": length, "backend": backend, "error": str(e)})
                continue
            out += [{"completion_len": length, "training": pl.choice.candidate.label, "dp_size": pl.choice.dp_size,
                     **p.as_dict()} for p in phases]
    if args.json:
        print(json.dumps({"rl": args.rl, "cluster": cluster.name, "model": model.name, "rows": out}))
        return 0
    print(f"GRPO step of {model.name} on {cluster.name} ({cluster.world_size} ranks): {args.completions} completions "
          f"a step of a {args.prompt_len}-token prompt, ZeRO-{args.zero_stage}, reference "
          f"{'off' if args.no_reference else 'on'}, old policy {'on' if args.old_policy else 'off'}; seconds and "
          "GiB per rank (planner/rl.py: decode rates are assumptions, Note [An RL step])")
    print(f"{'completion':>10} {'generation':18} {'seq/rank':>8} {'gen s':>8} {'weights s':>9} {'score s':>8} "
          f"{'train s':>8} {'step s':>8} {'KV GiB':>7} {'gen GiB':>8} {'train GiB':>9} fits  training")
    for r in out:
        if "error" in r:
            print(f"{r['completion_len']:>10} {r['backend']:18} error: {r['error'].splitlines()[0]}")
            continue
        name = f"{r['backend']} {'split' if r['split'] else 'redundant'}"
        print(f"{r['completion_len']:>10} {name:18} {r['sequences_per_rank']:>8} {r['generation_s']:8.1f} "
              f"{r['weights_s']:9.2f} {r['scoring_policy_s'] + r['scoring_reference_s']:8.1f} {r['training_s']:8.1f} "
              f"{r['step_s']:8.1f} {r['kv_cache_bytes'] / GIB:7.1f} {r['generation_bytes'] / GIB:8.1f} "
              f"{r['training_bytes'] / GIB:9.1f} {'yes' if r['fits'] else 'OOM':4}  {r['training']} "
              f"(x{r['dp_size']} replicas)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
