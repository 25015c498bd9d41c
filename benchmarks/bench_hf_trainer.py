"""The Trainer path end to end: transformers' ``Trainer`` and TRL's ``SFTTrainer`` with ds_wallfacer against the
same trainer on one rank (the loss), and the Trainer with DeepSpeed's own Ulysses (ALST, through accelerate's
``ParallelismConfig``) on the same ranks (tokens/s).

    python benchmarks/bench_hf_trainer.py                      # 4 CPU ranks, 1024 tokens, 8 steps (~10 min)
    python benchmarks/bench_hf_trainer.py --seq-len 2048 --only trainer

Every run is the shipped example under the real launcher, ``deepspeed --num_gpus N launch/train_hf.py`` or
``launch/train_trl.py`` (``benchmarks/hf_trainer_alst.py`` for ALST), with the example ds_config of its mode
(``wallfacer``: ZeRO-2, ``ulysses``: ZeRO-3, ``hybrid``: ZeRO-1, AdamW, clipping 1.0 from the Trainer), the
tiny Llama preset, fp32, micro-batch 1, gradient accumulation 2, evaluation once at the end. The one-rank
reference runs the ``wallfacer`` config, whose "auto" size is P = 1 there. Per run: the final training loss and
the eval loss against the one-rank run of the same trainer, and tokens/s over all ranks (real tokens / the
Trainer's ``train_runtime``: first step and the trainer's own overheads included, as a user sees them).
ALST's loss is weighted as its tutorial does (per-rank means all-gathered), so it matches ours only to AdamW's
near scale-invariance. Prints one table, writes ``runs/bench/hf_trainer/`` (result.json, plot.png) and ends with
one JSON line: ``max_loss_diff`` per trainer and ``ulysses_over_alst`` (tokens/s ratio, same ranks and config).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (add_job_options, add_out_option, emit, job_row, plot_path,  # noqa: E402
                               print_table, run_jobs, save_plot)

SCRIPTS = {"trainer": ROOT / "launch" / "train_hf.py", "sft": ROOT / "launch" / "train_trl.py",
           "alst": ROOT / "benchmarks" / "hf_trainer_alst.py"}


def configurations(args: argparse.Namespace) -> list[dict]:
    out = []
    for trainer in ("trainer", "sft"):
        # one-rank references: ZeRO-3 (ulysses.json) builds the model under zero.Init, whose seeded weights differ
        # from a plain build's, so ZeRO-3 runs get a ZeRO-3 reference; hybrid (P = 4 fixed) takes the wallfacer one
        out += [dict(trainer=trainer, config=c, ranks=1) for c in ("wallfacer", "ulysses")]
        out += [dict(trainer=trainer, config=c, ranks=args.ranks) for c in ("wallfacer", "ulysses", "hybrid")]
        if trainer == "trainer":
            out.append(dict(trainer="alst", config="ulysses", ranks=args.ranks))
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    return [c for c in out if not only or c["trainer"] in only or (c["trainer"] == "alst" and "trainer" in only)]


def _run(cfg: dict, args: argparse.Namespace) -> dict:
    length = "--max_length" if cfg["trainer"] == "sft" else "--seq_len"

    def options(out: str) -> list:
        return ["--deepspeed_config", cfg["config"], length, args.seq_len, "--steps", args.steps,
                "--eval_steps", 10 * args.steps, "--output_dir", out]

    row = job_row(cfg, SCRIPTS[cfg["trainer"]], options, args,
                  label=f"{cfg['trainer']} {cfg['config']} x{cfg['ranks']}")
    if "error" not in row:
        print(f"  {cfg['trainer']:8s} {cfg['config']:10s} x{cfg['ranks']}  loss {row['final_loss']:.6f}  "
              f"{row['tokens_per_s']:8.0f} tok/s  ({row['job_s']:.0f} s)", flush=True)
    return row


def _report(args: argparse.Namespace, rows: list[dict], wall_s: float) -> dict:
    ok = [r for r in rows if "error" not in r]
    ref = {(r["trainer"], r["config"]): r for r in ok if r["ranks"] == 1}
    alst = next((r for r in ok if r["trainer"] == "alst"), None)

    def diff(r: dict, key: str) -> float | None:
        trainer = "trainer" if r["trainer"] == "alst" else r["trainer"]
        base = ref.get((trainer, r["config"])) or ref.get((trainer, "wallfacer"))
        if base is None or r.get(key) is None or base.get(key) is None:
            return None
        return abs(r[key] - base[key])

    print(f"\ntiny Llama, {args.seq_len} tokens per sequence (SFT: per packed row), {args.steps} steps, fp32, "
          f"{args.threads} thread(s) per rank; loss differences against the same trainer on one rank")
    print_table([("trainer", "<"), ("config", "<"), ("mode", "<"), ("ranks", "d"), ("final loss", ".6f"),
                 ("|d loss|", ".1e"), ("eval loss", ".6f"), ("|d eval|", ".1e"), ("tok/s", ".0f"),
                 ("vs ALST", ".2f")],
                [[r["trainer"], r["config"], r["mode"], r["ranks"], r["final_loss"], diff(r, "final_loss"),
                  r.get("eval_loss"), diff(r, "eval_loss"), r["tokens_per_s"],
                  r["tokens_per_s"] / alst["tokens_per_s"] if alst and r["trainer"] == "trainer" and r["ranks"] > 1
                  else None] for r in ok])
    for r in rows:
        if "error" in r:
            print(f"{r['trainer']} {r['config']} x{r['ranks']}: failed: {r['error']}")
    summary: dict[str, Any] = dict(bench="hf_trainer", ranks=args.ranks, seq_len=args.seq_len, steps=args.steps,
                                   wall_s=round(wall_s))
    for trainer in ("trainer", "sft"):
        diffs = [d for r in ok if r["trainer"] == trainer and r["ranks"] > 1
                 for d in (diff(r, "final_loss"), diff(r, "eval_loss")) if d is not None]
        if diffs:
            summary[f"max_loss_diff_{trainer}"] = max(diffs)
    ours = next((r for r in ok if r["trainer"] == "trainer" and r["config"] == "ulysses" and r["ranks"] > 1), None)
    if ours and alst:
        summary["ulysses_over_alst"] = round(ours["tokens_per_s"] / alst["tokens_per_s"], 3)
        best = max((r for r in ok if r["trainer"] == "trainer" and r["ranks"] > 1), key=lambda r: r["tokens_per_s"])
        summary["best_over_alst"] = {best["config"]: round(best["tokens_per_s"] / alst["tokens_per_s"], 3)}
    summary["results"] = rows
    save_plot(plot_path(args), lambda plt: _draw(ok, plt), dpi=110)
    emit(summary, args.out / "result.json")
    return summary


def _draw(rows: list[dict], plt):
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [f"{r['trainer']} {r['config']} x{r['ranks']}" for r in rows]
    colors = ["tab:gray" if r["ranks"] == 1 else "tab:red" if r["trainer"] == "alst" else "tab:blue" for r in rows]
    ax.barh(names, [r["tokens_per_s"] for r in rows], color=colors)
    ax.set_xlabel("tokens/s (all ranks)")
    ax.invert_yaxis()
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--only", default="", help="comma-separated trainers: trainer (with ALST), sft")
    add_job_options(p, steps=8)
    add_out_option(p, "hf_trainer")
    args = p.parse_args(argv)
    return run_jobs(args, configurations(args), _run, _report)


if __name__ == "__main__":
    sys.exit(main())
