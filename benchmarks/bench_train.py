"""End-to-end training throughput, memory, communication and loss: ring, WallFacer, Ulysses, hybrid (each with
and without MsT), DeepSpeed's own ALST Ulysses (plain, and with its TiledMLP + TiledFusedLogitsLoss tiling and
checkpointing), and a non-parallel run, on the same HF Llama, data and steps.

    python benchmarks/bench_train.py                        # 4 CPU ranks, 2048 tokens (about 10 min on 2 cores)
    python benchmarks/bench_train.py --seq-len 4096 --steps 4
    python benchmarks/bench_train.py --p8                   # adds ring vs WallFacer C = 2 on 8 ranks
    python benchmarks/bench_train.py --ckpt-seq-len 8192    # adds layer checkpointing on / off at a longer length
    python benchmarks/bench_train.py --only ulysses,alst    # a subset (names as in the table)
    python benchmarks/bench_train.py --predict-only runs/bench/train/result.json   # predictions for a past run

Every configuration is its own ``deepspeed --num_gpus N`` job (CPU ranks where there is no GPU; this script is
the worker too, with ``--worker SPEC``; the ALST jobs live in ``bench_train_alst.py``): same model (seeded), same random-token batches (a skewed unigram
distribution, so the loss falls), AdamW, ``gradient_clipping`` 0, ZeRO-1, fp32. Per configuration:

- tokens/s: sequence length / median step time over the timed steps (a step ends when the slowest rank ends),
  and "best" over the fastest step (the least disturbed on a shared machine);
  with ``--repeat N`` every configuration runs N times, round-robin, and the median is reported;
- memory per rank: peak resident set (ru_maxrss; CUDA: max allocated) and the same minus a model-only baseline
  taken after a first step of 128 tokens (parameters, gradients, AdamW states, DeepSpeed buffers), max over ranks;
- bytes sent per rank per step by kind: our ``CommLayer`` counts (``sp.comm``, every phase); ALST: its Ulysses
  all-to-alls counted around ``deepspeed.comm.all_to_all_single`` (its per-layer position-id all-gather and the
  data adapter's gathers are not counted; ZeRO's gradient traffic is counted for neither);
- the loss of every step (the global token mean; ALST: its documented all-gather weighting);
- the planner's predicted step time (``predicted_step_s``: ``resolve_auto`` with this host's calibration, the path
  "auto" takes; ALST predicted as our Ulysses of the same P) and predicted / measured (target: within 25 %).

ALST's documented loss weighting and DeepSpeed's mpu give its gradients another scale than the non-parallel run
(docs/design/layouts.md); AdamW is nearly scale-invariant, so its losses agree with ours to a few 1e-6, not exactly.
With tiling, each rank back-propagates its share of the global token mean as it is: TiledFusedLogitsLoss adds the
head weight's gradient inside its forward for an incoming gradient of 1, so the tutorial's all-gather weighting
(which scales that incoming gradient) would give the head another gradient scale than the rest of the model.
Prints one table, writes ``runs/bench/train/`` (``--out``: result.json, and plot.png with matplotlib), ends with
one JSON line. Targets printed against: our Ulysses >= ALST tokens/s at the same P, with the same loss.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import (  # first: the repository on sys.path
    ROOT, add_out_option, emit, free_port, plot_path, print_table, remove_shm_segments, save_plot,
)

MODEL = dict(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=1 << 17, rms_norm_eps=1e-5, tie_word_embeddings=False)
_MARK = "BENCH_TRAIN_RESULT "
TINY = 128
"""Tokens of the first step, the same in every job (divisible by 2P up to P = 64): its memory is the baseline."""


# ----------------------------------------------------------------------------------------------- configurations
def configurations(args: argparse.Namespace) -> list[dict]:
    """The jobs to run, in order: name, system, ranks, sequence length, and the "wallfacer" section (ours)."""
    p, n = args.ranks, args.seq_len
    modes = {
        "ring": dict(mode="wallfacer", ring_count=1),
        "wallfacer C=2": dict(mode="wallfacer", ring_count=2),
        "ulysses": dict(mode="ulysses", ulysses_degree=p),
        "hybrid": dict(mode="hybrid", ulysses_degree=2, ring_count=1),
    }
    mst = {"mini_sequence": {}}  # MsT with its default DeepSpeed layer checkpointing
    out = [dict(name="single rank", system="ours", ranks=1, seq_len=n, section=dict(sequence_parallel_size=1))]
    for name, sec in modes.items():
        out.append(dict(name=name, system="ours", ranks=p, seq_len=n, section=dict(sequence_parallel_size=p, **sec)))
        out.append(dict(name=f"{name} + MsT", system="ours", ranks=p, seq_len=n,
                        section=dict(sequence_parallel_size=p, **sec, **mst)))
    out.append(dict(name="alst", system="alst", ranks=p, seq_len=n, tiled=False))
    out.append(dict(name="alst + tiling", system="alst", ranks=p, seq_len=n, tiled=True))
    if args.p8:
        for name in ("ring", "wallfacer C=2"):
            out.append(dict(name=f"{name} P=8", system="ours", ranks=8, seq_len=n,
                            section=dict(sequence_parallel_size=8, **modes[name])))
    if args.ckpt_seq_len:
        # layer checkpointing alone (no MsT chunking) against none, at a longer length; extra keys of the
        # mini_sequence section (e.g. a recompute switch) come from --ckpt-section
        ckpt = {"mini_sequence": {"mlp": False, "lm_head": False, **json.loads(args.ckpt_section)}}
        for name in ("ulysses", "wallfacer C=2"):
            base = dict(sequence_parallel_size=p, **modes[name])
            out.append(dict(name=f"{name} @{args.ckpt_seq_len}", system="ours", ranks=p, seq_len=args.ckpt_seq_len,
                            section=base, group="ckpt"))
            out.append(dict(name=f"{name} + ckpt @{args.ckpt_seq_len}", system="ours", ranks=p,
                            seq_len=args.ckpt_seq_len, section={**base, **ckpt}, group="ckpt"))
    if args.only:
        keep = [s.strip() for s in args.only.split(",")]
        out = [c for c in out if any(c["name"] == k or c["name"].startswith(k + " ") for k in keep)]
    return out


# ----------------------------------------------------------------------------------------------- worker (one rank)
def _batches(spec: dict) -> list[Any]:
    """[tiny] + warm-up + timed full batches of shape [1, S], identical on every rank and in every job."""
    import torch

    vocab = MODEL["vocab_size"]
    gen = torch.Generator().manual_seed(1234)
    probs = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1  # Zipf-like unigram: learnable
    lengths = [TINY] + [spec["seq_len"]] * (spec["warmup"] + spec["steps"])
    return [torch.multinomial(probs, n, replacement=True, generator=gen).view(1, n) for n in lengths]


def _model(attn: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL, attn_implementation=attn)).float().train()


def _ds_config(spec: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": spec["zero"]}, "steps_per_print": 1 << 30, "wall_clock_breakdown": False}


def _ours(spec: dict, ids: list):
    """(engine, step(batch) -> loss, comm) for our integration."""
    import torch

    import ds_wallfacer.integration as wfi

    model = _model("wallfacer")
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    cfg = {**_ds_config(spec), "wallfacer": spec["section"]}
    engine, sp = wfi.initialize(model=model, config=cfg, optimizer=opt, seq_len=spec["seq_len"])
    shards = list(sp.dataloader(({"input_ids": x, "labels": x.clone()} for x in ids), batch_size=1))

    def step(i: int) -> Any:
        loss = engine(**{k: v.to(engine.device) for k, v in shards[i].items()})
        engine.backward(loss)
        engine.step()
        return loss.detach()

    return engine, step, sp.comm, sp.setup.describe()


def worker(spec_path: str) -> None:
    import resource
    import statistics

    import torch
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ids = _batches(spec)
    if spec["system"] == "alst":
        from bench_train_alst import alst_job  # benchmarks/ is this script's directory: first on sys.path

        engine, step, comm, layout = alst_job(spec, ids, build_model=_model, ds_config=_ds_config(spec),
                                              vocab=MODEL["vocab_size"])
    else:
        engine, step, comm, layout = _ours(spec, ids)
    cuda = torch.cuda.is_available()

    def peak_gib() -> float:
        if cuda:
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    step(0)  # tiny: allocates gradients, optimizer states and DeepSpeed's buffers
    base = peak_gib()
    times, losses = [], []
    for i in range(1, len(ids)):
        comm.reset()
        dist.barrier()
        t0 = time.perf_counter()
        loss = step(i)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    sent = dict(comm.sent)  # the last step's
    calls = {f"{ph}/{kd}": n for (ph, kd), n in getattr(comm, "calls", {}).items()}
    times = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
    mine = dict(peak=peak_gib(), base=base, sent={f"{ph}/{kd}": b for (ph, kd), b in sent.items()})
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        timed = times[spec["warmup"]:].tolist()
        kinds: dict[str, int] = {}
        for key, b in every[0]["sent"].items():
            kinds[key.split("/")[1]] = kinds.get(key.split("/")[1], 0) + b
        res = dict(name=spec["name"], system=spec["system"], ranks=spec["ranks"], seq_len=spec["seq_len"],
                   layout=layout, group=spec.get("group", "main"), step_s=statistics.median(timed),
                   tokens_per_s=spec["seq_len"] / statistics.median(timed),
                   tokens_per_s_best=spec["seq_len"] / min(timed), step_times=timed, losses=losses,
                   final_loss=losses[-1], peak_gib=max(e["peak"] for e in every),
                   act_gib=max(e["peak"] - e["base"] for e in every), model_gib=max(e["base"] for e in every),
                   bytes_by_kind=kinds, bytes_by_phase_kind=every[0]["sent"], calls=calls,
                   bytes_total=sum(kinds.values()), bytes_max_rank=max(sum(e["sent"].values()) for e in every))
        print(_MARK + json.dumps(res), flush=True)
    if hasattr(engine, "destroy"):
        engine.destroy()


# ----------------------------------------------------------------------------------------------- prediction
def predicted_step_s(cfg: dict, args: argparse.Namespace) -> float | None:
    """The planner's step time for a configuration, through the path "auto" takes at start-up (``resolve_auto``
    with this host's calibration): the "wallfacer" section as the job's, fp32, ZeRO ``--zero``. ALST runs are
    predicted as our Ulysses of the same P (with MsT for its tiling), the nearest configuration the model knows."""
    from ds_wallfacer.config import WallFacerConfig, parse_ds_config
    from ds_wallfacer.planner.auto import PlanInputs, resolve_auto

    section = cfg.get("section")
    if cfg["system"] == "alst":
        section = dict(sequence_parallel_size=cfg["ranks"], mode="ulysses", ulysses_degree=cfg["ranks"],
                       **({"mini_sequence": {}} if cfg.get("tiled") else {}))
    fp32_zero = parse_ds_config({"zero_optimization": {"stage": args.zero}})
    inputs = PlanInputs(model=MODEL, seq_len=cfg["seq_len"], run=fp32_zero,
                        default_cluster="cpu", environ={})
    try:
        setup = resolve_auto(WallFacerConfig.from_dict(section), world_size=cfg["ranks"],
                             num_heads=MODEL["num_attention_heads"], num_kv_heads=MODEL["num_key_value_heads"],
                             ranks_per_node=cfg["ranks"], planner_inputs=inputs)
    except ValueError:
        return None
    return (setup.planner_choice or {}).get("step_s")


# ----------------------------------------------------------------------------------------------- driver
def _run(cfg: dict, args: argparse.Namespace, port: int) -> dict:
    spec = {**cfg, "warmup": args.warmup, "steps": args.steps, "lr": args.lr, "logits_mib": args.logits_mib,
            "zero": args.zero}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        import torch

        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
    except ImportError:
        pass
    cmd = ["deepspeed", "--num_gpus", str(cfg["ranks"]), "--master_port", str(port), __file__, "--worker", f.name]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.job_timeout_s)
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, err, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "", "timeout"
    finally:
        os.unlink(f.name)
        remove_shm_segments(port)  # leftovers of a job that died before releasing them
    lines = [ln.split(_MARK, 1)[1] for ln in out.splitlines() if _MARK in ln]
    if rc != 0 or not lines:
        tail = "\n".join((out + err).splitlines()[-25:])
        print(f"{cfg['name']}: failed (rc {rc}):\n{tail}", file=sys.stderr)
        return dict(name=cfg["name"], system=cfg["system"], ranks=cfg["ranks"], seq_len=cfg["seq_len"],
                    group=cfg.get("group", "main"), error=f"rc {rc}")
    res = json.loads(lines[-1])
    res["job_s"] = round(time.time() - t0, 1)
    print(f"  {res['name']:28s} {res['tokens_per_s']:8.0f} tok/s  loss {res['final_loss']:.6f}  "
          f"act {res['act_gib']:.3f} GiB  ({res['job_s']:.0f} s)", flush=True)
    return res


def _merge(runs: list[dict]) -> dict:
    """One row from the repeats of a configuration: medians of tokens/s and memory, every run's tokens/s kept."""
    import statistics

    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[-1]
    row = dict(ok[0])
    for key in ("tokens_per_s", "tokens_per_s_best", "step_s", "peak_gib", "act_gib", "model_gib"):
        row[key] = statistics.median(r[key] for r in ok)
    row["tokens_per_s_runs"] = [round(r["tokens_per_s"], 1) for r in ok]
    row["final_loss_runs"] = sorted({r["final_loss"] for r in ok})  # one value: the runs are deterministic
    row["failed_runs"] = len(runs) - len(ok)
    return row


def _report(args: argparse.Namespace, rows: list[dict], wall_s: float) -> None:
    ok = [r for r in rows if "error" not in r]
    print(f"\nLlama {MODEL['hidden_size']}d x {MODEL['num_hidden_layers']} layers, heads "
          f"{MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']}, vocab {MODEL['vocab_size']}, fp32, ZeRO-1, "
          f"AdamW lr {args.lr}, {args.warmup} warm-up + {args.steps} timed steps, {args.threads} thread(s) per rank, "
          f"median of {args.repeat} run(s); "
          f"memory GiB per rank (max), bytes = MiB sent by rank 0 in one step")
    kinds = ("all_gather", "reduce_scatter", "ring", "skew", "all_to_all", "check")
    single = next((r for r in ok if r["ranks"] == 1), None)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))  # the calibration measures as a rank computes
    cfg_by_name = {c["name"]: c for c in configurations(args)}
    for r in ok:  # the planner's prediction (this host's calibration) beside the measured median step
        cfg = cfg_by_name.get(r["name"])
        r["predicted_step_s"] = predicted_step_s(cfg, args) if cfg else None
        r["predicted_over_measured"] = r["predicted_step_s"] / r["step_s"] if r["predicted_step_s"] else None
    print_table([("configuration", "<"), ("P", "d"), ("tokens", "d"), ("step s", ".3f"), ("pred s", ".3f"),
                 ("pred/meas", ".2f"), ("tok/s", ".0f"), ("best", ".0f"),
                 ("vs 1", ".2f"), ("final loss", ".6f"), ("peak", ".3f"), ("act", ".3f"), ("MiB", ".2f"),
                 *((k, ".2f") for k in kinds)],
                [[r["name"], r["ranks"], r["seq_len"], r["step_s"], r["predicted_step_s"], r["predicted_over_measured"],
                  r["tokens_per_s"], r.get("tokens_per_s_best", float("nan")),
                  r["tokens_per_s"] / single["tokens_per_s"] if single and r["seq_len"] == single["seq_len"] else None,
                  r["final_loss"], r["peak_gib"], r["act_gib"], r["bytes_total"] / 2**20,
                  *(r["bytes_by_kind"].get(k, 0) / 2**20 for k in kinds)] for r in ok])
    for r in rows:
        if "error" in r:
            print(f"{r['name']} (P = {r['ranks']}, {r['seq_len']} tokens): failed: {r['error']}")
    summary: dict[str, Any] = dict(bench="train", model=MODEL, ranks=args.ranks, seq_len=args.seq_len,
                                   steps=args.steps, warmup=args.warmup, wall_s=round(wall_s))
    by_name = {r["name"]: r for r in ok}
    for ours, alst in (("ulysses", "alst"), ("ulysses + MsT", "alst + tiling")):
        if ours in by_name and alst in by_name:
            a, b = by_name[ours], by_name[alst]
            ratio, dloss = a["tokens_per_s"] / b["tokens_per_s"], abs(a["final_loss"] - b["final_loss"])
            best = a.get("tokens_per_s_best", 0.0) / max(b.get("tokens_per_s_best", 0.0), 1e-9)
            met = ratio >= 1.0 and dloss <= 1e-4
            print(f"target: {ours} >= {alst} tokens/s with the same loss: {ratio:.3f}x (best steps {best:.3f}x), "
                  f"|d loss| {dloss:.2e} -> {'met' if met else 'MISSED'}")
            summary[f"{ours} / {alst}"] = dict(tokens_per_s_ratio=round(ratio, 3), best_step_ratio=round(best, 3),
                                               loss_diff=dloss, met=met)
    ratios = [r["predicted_over_measured"] for r in ok if r.get("predicted_over_measured")]
    if ratios:
        worst = max(ratios, key=lambda x: abs(x - 1))
        met = all(0.75 <= x <= 1.25 for x in ratios)
        print(f"target: predicted step within 25 % of measured in every configuration: worst predicted/measured "
              f"{worst:.2f} -> {'met' if met else 'MISSED'}")
        summary["predicted_over_measured"] = {r["name"]: round(r["predicted_over_measured"], 3) for r in ok
                                              if r.get("predicted_over_measured")}
        summary["prediction_target_met"] = met
    ref = by_name.get("single rank")
    if ref:
        same = [r for r in ok if r["seq_len"] == ref["seq_len"] and r["system"] == "ours"]
        summary["max_loss_diff_vs_single_rank_ours"] = max(abs(r["final_loss"] - ref["final_loss"]) for r in same)
    for name in ("ulysses", "wallfacer C=2"):
        on = by_name.get(f"{name} + ckpt @{args.ckpt_seq_len}")
        off = by_name.get(f"{name} @{args.ckpt_seq_len}")
        if on and off:
            summary[f"{name} ckpt/no-ckpt tokens/s @{args.ckpt_seq_len}"] = round(on["tokens_per_s"] / off["tokens_per_s"], 3)
            print(f"checkpointing, {name} at {args.ckpt_seq_len} tokens: {on['tokens_per_s']:.0f} vs "
                  f"{off['tokens_per_s']:.0f} tok/s without = {on['tokens_per_s'] / off['tokens_per_s']:.3f}x")
    summary["results"] = [{k: v for k, v in r.items() if k not in ("step_times",)} for r in rows]
    save_plot(plot_path(args), lambda plt: _draw(ok, plt), dpi=110)
    emit(summary, args.out / "result.json")


def _draw(rows: list[dict], plt):
    if not rows:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    names = [f"{r['name']}" + ("" if r["name"].endswith(f"@{r['seq_len']}") else f" ({r['ranks']}r)") for r in rows]
    colors = ["tab:gray" if r["ranks"] == 1 else "tab:red" if r["system"] == "alst" else "tab:blue" for r in rows]
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "act_gib", "activation memory, GiB/rank")):
        ax.barh(names, [r[key] for r in rows], color=colors)
        ax.set_xlabel(label)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    for r in rows:
        axes[2].plot(range(1, len(r["losses"]) + 1), r["losses"], marker=".", label=r["name"])
    axes[2].set_xlabel("step (warm-up included)")
    axes[2].set_ylabel("loss")
    axes[2].legend(fontsize=7)
    axes[2].grid(alpha=0.3)
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="P of the parallel configurations")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2, 3], help="ZeRO stage of every job")
    p.add_argument("--logits-mib", type=int, default=256, help="ALST tiling: fp32 logits per TiledFusedLogitsLoss "
                   "shard (ours: mini_sequence's default budget, 256 MiB)")
    p.add_argument("--p8", action="store_true", help="also ring and WallFacer C = 2 on 8 ranks")
    p.add_argument("--ckpt-seq-len", type=int, default=0, help="also Ulysses and WallFacer C = 2 with and without "
                   "layer checkpointing at this length")
    p.add_argument("--ckpt-section", default="{}", help="extra mini_sequence keys (JSON) of the checkpointing runs")
    p.add_argument("--only", default="", help="comma-separated configuration names (a name also selects its "
                   "'+ MsT' / 'P=8' variants)")
    p.add_argument("--repeat", type=int, default=1, help="runs of every configuration, round-robin (medians)")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    p.add_argument("--job-timeout-s", type=int, default=900)
    add_out_option(p, "train")
    p.add_argument("--predict-only", default=None, help="a result.json of an earlier run: print its table with the "
                   "planner's predictions (this host's calibration) without running anything")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # the deepspeed launcher's
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    for n in (args.seq_len, args.ckpt_seq_len):
        if n and n % (2 * max(args.ranks, 8 if args.p8 else 1)):
            raise SystemExit(f"--seq-len / --ckpt-seq-len {n} must be divisible by 2P")
    if args.predict_only:
        old = json.loads(Path(args.predict_only).read_text())
        for key in ("ranks", "seq_len", "steps", "warmup"):
            setattr(args, key, old.get(key, getattr(args, key)))
        args.p8 = any(r["ranks"] == 8 for r in old["results"])
        cks = [r["seq_len"] for r in old["results"] if r.get("group") == "ckpt"]
        args.ckpt_seq_len = cks[0] if cks else 0
        _report(args, old["results"], old.get("wall_s", 0.0))
        return
    cfgs = configurations(args)
    print(f"{len(cfgs)} jobs: " + ", ".join(c["name"] for c in cfgs), flush=True)
    t0 = time.time()
    runs: list[list[dict]] = [[] for _ in cfgs]
    for rep in range(args.repeat):  # round-robin: a busy machine's drift spreads over every configuration
        for i, c in enumerate(cfgs):
            runs[i].append(_run(c, args, free_port()))
    _report(args, [_merge(r) for r in runs], time.time() - t0)


if __name__ == "__main__":
    main()
