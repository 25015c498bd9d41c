"""TRL's DPO and GRPO trainers with sequence parallelism against the same TRL trainer on one rank: tokens/s and
activation bytes per rank, side by side in one run.

    python benchmarks/bench_rl.py                          # 4 CPU ranks, rows of ~1K tokens, 4 steps (~4-6 min)
    python benchmarks/bench_rl.py --filler 64 --only dpo   # longer rows
    python benchmarks/bench_rl.py --only rollouts          # GRPO's generation alone: split against redundant

Every run is a shipped example under the real launcher: ``deepspeed --num_gpus N launch/train_dpo.py`` or
``launch/train_grpo.py``, with ``--trainer trl`` for TRL's own trainer (one rank; the example ds_config without its
``"wallfacer"`` section) and the Wallfacer trainer under the example config of each mode (``wallfacer``: ZeRO-2,
WallFacer; ``ulysses``: ZeRO-3 in the example, ZeRO-2 here, since the activation probe cannot run under ZeRO-3;
``hybrid``: ZeRO-1, U = 2 x ring). The tiny Llama preset, fp32, the synthetic
arithmetic data with ``--filler`` context sentences before each question (the row length), micro-batch 1 pair (DPO:
2 rows) or 4 completions (GRPO), gradient accumulation 2. Per run: the final loss (GRPO: and the last step's mean
reward) against the one-rank run, tokens/s
over all ranks (TRL's ``num_tokens`` / ``train_runtime``: generation, the reference and the trainer's overheads
included), and the activation bytes of step 3 on rank 0 (what autograd saves for backward in one micro-step,
``StepActivationBytes``: the part of memory that grows with the sequence and that sequence parallelism divides).

GRPO runs train a LoRA adapter (rank 4) with beta 0.04 (the base model is the reference) and two optimizer passes
over each generation round (``num_iterations`` 2: the old policy is scored), so that a step has every phase, and
decode greedily: the split rollouts then equal TRL's one process, and ``grpo_max_loss_diff`` /
``grpo_max_last_reward_diff`` are the largest differences of the final loss and last reward from TRL's run.
GRPO's rollouts: the WallFacer run generates split over the group (each rank its share of the group's prompts, then
one gather); one more run, ``--redundant_rollouts`` (the trainer's ``redundant_rollouts``), has every rank generate
the group's whole batch, as the trainer did before. Per rank of the group: the completion tokens it generated and the
seconds it spent in rollouts (generation and the gather); ``generated_token_share_per_rank`` is the largest rank's
tokens over the group's batch (1 when redundant; at best 1/P plus a completion's share when split) and
``generation_split_over_redundant`` the slowest rank's rollout seconds, split over redundant. A second table gives
per rank the seconds of each phase of the run (``hf_trainer/phases.py``): generation, scoring the old policy and the
reference, the rest of the rollouts (rewards, advantages), training (forward and backward of the loss).

TRL + ALST: TRL's DPO and GRPO trainers have no DeepSpeed-Ulysses path (accelerate's ``ParallelismConfig`` sequence
parallelism is wired into its SFT trainer only; their losses sum over whole sequences, which a sharded batch would
cut), so there is no ALST column. On this machine 4 ranks share 2 cores: tokens/s shows the cost of the sharded
path at small sizes, not the speed-up a GPU per rank gives; the activation ratio is what carries over.
Prints one table, writes ``runs/bench/rl/`` (result.json, plot.png) and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import (add_job_options, add_out_option, emit, job_row, plot_path,  # noqa: E402
                               print_table, run_jobs, save_plot)

SCRIPTS = {"dpo": ROOT / "launch" / "train_dpo.py", "grpo": ROOT / "launch" / "train_grpo.py"}
MEASURED_STEP = 3
GRPO_OPTIONS = ["--lora_r", 4, "--lora_away_from_base", "--beta", 0.04, "--num_iterations", 2, "--greedy"]
"""Every GRPO run (TRL's too) scores both: the reference (beta > 0, the base model under the LoRA adapter) and the old
policy (two optimizer passes over each round: importance sampling); greedy decoding, so that the split rollouts equal
TRL's one process and the losses and rewards are compared (greedy completions of a prompt are alike and their
advantages zero: the adapter starts away from the base model, so the KL term trains it)."""


def configurations(args: argparse.Namespace) -> list[dict]:
    only = {s.strip() for s in args.only.split(",") if s.strip()}
    out = []
    for trainer in ("dpo", "grpo"):
        if only and trainer not in only:
            continue
        out.append(dict(trainer=trainer, impl="trl", config="wallfacer", ranks=1))
        out += [dict(trainer=trainer, impl="wallfacer", config=c, ranks=args.ranks)
                for c in ("wallfacer", "ulysses", "hybrid")]
    if only and "rollouts" in only and "grpo" not in only:
        out.append(dict(trainer="grpo", impl="wallfacer", config="wallfacer", ranks=args.ranks))
    if not only or only & {"grpo", "rollouts"}:
        out.append(dict(trainer="grpo", impl="wallfacer", config="wallfacer", ranks=args.ranks,
                        generation="redundant"))
    return out


def _config(name: str, out: str) -> str:
    """The example ds_config ``name``, as a path; ZeRO-3 lowered to 2 (the activation probe reads autograd's saved
    tensors, which ZeRO-3's parameters cannot pass through)."""
    from ds_wallfacer.examples import find_config

    cfg = json.loads(find_config(name).read_text())
    if cfg.get("zero_optimization", {}).get("stage") == 3:
        cfg["zero_optimization"]["stage"] = 2
    path = Path(out) / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _run(cfg: dict, args: argparse.Namespace) -> dict:
    def options(out: str) -> list:
        return ["--deepspeed_config", _config(cfg["config"], out), "--trainer", cfg["impl"], "--filler", args.filler,
                "--steps", args.steps, "--measure_step", MEASURED_STEP, "--eval_steps", 10 * args.steps,
                "--output_dir", out] + (GRPO_OPTIONS if cfg["trainer"] == "grpo" else []) \
            + (["--redundant_rollouts"] if cfg.get("generation") == "redundant" else [])

    row = job_row(cfg, SCRIPTS[cfg["trainer"]], options, args, label=_name(cfg))
    if "error" not in row:
        print(f"  {_name(cfg):36s}  loss {row['final_loss']:.6f}  {row['tokens_per_s']:8.0f} tok/s  "
              f"{row['activation_bytes'] / 2**20:7.1f} MiB  ({row['job_s']:.0f} s)", flush=True)
    return row


def _name(cfg: dict) -> str:
    extra = " redundant" if cfg.get("generation") == "redundant" else ""
    return f"{cfg['trainer']} {cfg['impl']} {cfg['config']} x{cfg['ranks']}{extra}"


def _rollouts(ok: list[dict]) -> dict[str, Any]:
    """GRPO's rollouts per rank, split (the WallFacer run) against redundant: a table and the summary's keys."""
    runs = {r.get("generation", "split"): r for r in ok if r["trainer"] == "grpo" and r["impl"] == "wallfacer"
            and r["config"] == "wallfacer" and r.get("rollouts")}
    if set(runs) != {"split", "redundant"}:
        return {}
    print_table([("rollouts", "<"), ("rank", "d"), ("prompts", "d"), ("tokens", "d"), ("share", ".3f"),
                 ("seconds", ".2f")],
                [[name, i, s["prompts"], s["tokens"], s["tokens"] / max(s["batch_tokens"], 1), s["seconds"]]
                 for name, r in runs.items() for i, s in enumerate(r["rollouts"])],
                title=f"\nGRPO rollouts over {len(runs['split']['rollouts'])} ranks (one group, config wallfacer)")

    phases = {name: r["phases"] for name, r in runs.items() if r.get("phases")}
    if phases:
        print_table([("phases", "<"), ("rank", "d"), ("generation s", ".2f"), ("score policy s", ".2f"),
                     ("score ref s", ".2f"), ("rest of rollout s", ".2f"), ("training s", ".2f")],
                    [[name, i, p["generation"], p["scoring_policy"], p["scoring_reference"], p["rollout_other"],
                      p["training"]] for name, every in phases.items() for i, p in enumerate(every)],
                    title="\nGRPO step phases per rank, seconds over the run (hf_trainer/phases.py)")

    def share(r: dict) -> float:
        return max(s["tokens"] / max(s["batch_tokens"], 1) for s in r["rollouts"])

    def seconds(r: dict) -> float:
        return max(s["seconds"] for s in r["rollouts"])

    return {"generated_token_share_per_rank": round(share(runs["split"]), 4),
            "generated_token_share_per_rank_redundant": round(share(runs["redundant"]), 4),
            "generation_seconds": {k: round(seconds(r), 3) for k, r in runs.items()},
            "generation_split_over_redundant": round(seconds(runs["split"]) / seconds(runs["redundant"]), 4),
            "phases_seconds_per_rank": {name: [{k: round(v, 3) for k, v in p.items()} for p in every]
                                        for name, every in phases.items()}}


def _report(args: argparse.Namespace, rows: list[dict], wall_s: float) -> dict:
    ok = [r for r in rows if "error" not in r]
    ref = {r["trainer"]: r for r in ok if r["impl"] == "trl"}

    def ratio(r: dict, key: str) -> float | None:
        base = ref.get(r["trainer"])
        return r[key] / base[key] if base and base.get(key) and r.get(key) is not None else None

    def diff(r: dict, key: str = "final_loss") -> float | None:
        base = ref.get(r["trainer"])
        return abs(r[key] - base[key]) if base and r.get(key) is not None and base.get(key) is not None else None

    print(f"\ntiny Llama, --filler {args.filler} (DPO rows ~{64 * (args.filler + 2)} tokens), {args.steps} steps, "
          f"fp32, {args.threads} thread(s) per rank; ratios against TRL's own trainer on one rank")
    print_table([("trainer", "<"), ("impl", "<"), ("config", "<"), ("mode", "<"), ("ranks", "d"),
                 ("final loss", ".6f"), ("|d loss|", ".1e"), ("|d reward|", ".1e"), ("tok/s", ".0f"),
                 ("tok/s ratio", ".2f"),
                 ("act MiB/rank", ".2f"), ("act ratio", ".2f")],
                [[r["trainer"], r["impl"] + (" redundant" if r.get("generation") else ""), r["config"], r.get("mode"), r["ranks"], r["final_loss"], diff(r),
                  diff(r, "last_reward"), r["tokens_per_s"], ratio(r, "tokens_per_s"), r["activation_bytes"] / 2**20,
                  ratio(r, "activation_bytes")] for r in ok])
    for r in rows:
        if "error" in r:
            print(f"{r['trainer']} {r['impl']} {r['config']} x{r['ranks']}: failed: {r['error']}")
    summary: dict[str, Any] = dict(bench="rl", ranks=args.ranks, filler=args.filler, steps=args.steps,
                                   wall_s=round(wall_s))
    for trainer in ref:
        ours = [r for r in ok if r["trainer"] == trainer and r["impl"] == "wallfacer" and not r.get("generation")]
        if ours:
            summary[f"{trainer}_activation_ratio"] = {r["config"]: round(ratio(r, "activation_bytes"), 3) for r in ours}
            summary[f"{trainer}_tokens_per_s_ratio"] = {r["config"]: round(ratio(r, "tokens_per_s"), 3) for r in ours}
    grpo = [r for r in ok if r["trainer"] == "grpo" and r["impl"] == "wallfacer"]
    if grpo and "grpo" in ref:
        summary["grpo_max_loss_diff"] = max(diff(r) for r in grpo)
        summary["grpo_max_last_reward_diff"] = max(diff(r, "last_reward") for r in grpo)
    summary.update(_rollouts(ok))
    summary["results"] = rows
    save_plot(plot_path(args), lambda plt: _draw(ok, plt), dpi=110)
    emit(summary, args.out / "result.json")
    return summary


def _draw(rows: list[dict], plt):
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    names = [_name(r) for r in rows]
    colors = ["tab:gray" if r["impl"] == "trl" else "tab:blue" for r in rows]
    axes[0].barh(names, [r["tokens_per_s"] for r in rows], color=colors)
    axes[0].set_xlabel("tokens/s (all ranks)")
    axes[1].barh(names, [r["activation_bytes"] / 2**20 for r in rows], color=colors)
    axes[1].set_xlabel(f"activation MiB per rank (step {MEASURED_STEP})")
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--filler", type=int, default=14, help="context sentences per question (~64 tokens each)")
    p.add_argument("--only", default="", help="comma-separated: dpo, grpo, rollouts (GRPO split and redundant)")
    add_job_options(p, steps=4)
    add_out_option(p, "rl")
    args = p.parse_args(argv)
    return run_jobs(args, configurations(args), _run, _report)


if __name__ == "__main__":
    sys.exit(main())
