"""What a checkpoint costs the training loop, synchronous against ``--async_save``, side by side in one run.

    python benchmarks/bench_checkpoint.py                 # 2 gloo CPU ranks, small-llama (24M parameters), ~2 min
    python benchmarks/bench_checkpoint.py --seq-len 512 --saves-per-mode 6

The ranks run the trainer itself (``Trainer``: build, start, ``train``; AdamW, ZeRO-2, P = all ranks,
``--save_total_limit 1``) with a save every ``--save-every`` steps, alternating synchronous and asynchronous saves
(``args.async_save`` flipped before each), so both see the same model, data and load on the machine. The trainer's
own methods are timed from outside (wrapped on the instance): the wall time of every loop iteration (train step,
log, save, the poll of a pending save), when each save began and when its marker was written. Per mode, per save
(rank 0's clock):

- step s: median iteration without a save or a write in flight (after 2 warm-up steps, the last left out);
- save step s: median iteration that includes a save; hiccup s = save step s - step s, the training thread's stall;
- steps while writing / their extra s: the iterations that started while the save's files were still being
  written (async only), and what they took beyond step s in all (the writer thread shares the cores), medians;
- total extra s: hiccup s + their extra s, what a save costs the run;
- marker after s: from the start of a save to its marker on disk (median; the slowest rank's);
- checkpoint MiB: one tag as the disk holds it.

Prints the table, saves a plot of every iteration's time (``--plot``) and ends with the JSON line (also written,
with every iteration's time, to ``runs/bench/checkpoint/result.json``, ``--out``).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from harness import add_out_option, emit, plot_path, print_table, run_ranks, save_plot  # first: repository on path

MODES = ("sync", "async")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2, help="gloo CPU ranks (sequence parallel over all of them)")
    ap.add_argument("--model", default="small-llama", help="the trainer's --model (a preset, a folder, a config)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--saves-per-mode", type=int, default=4, help="saves of each mode, alternating sync / async")
    ap.add_argument("--save-every", type=int, default=4, help="steps from one save to the next")
    add_out_option(ap, "checkpoint")
    return ap.parse_args(argv)


def _trainer_argv(args: argparse.Namespace, config: Path) -> list[str]:
    saves = 2 * args.saves_per_mode
    return ["--deepspeed_config", str(config), "--model", args.model, "--seq_len", str(args.seq_len),
            "--steps", str(saves * args.save_every + args.save_every - 1), "--save_every", str(args.save_every),
            "--save_total_limit", "1", "--eval_fraction", "0", "--lr", "1e-3", "--no_wandb", "--no_export",
            "--no_progress", "--no_save", "--watchdog_timeout", "0", "--output_dir", str(args.out / "run"),
            "--cache_dir", str(args.out / "token_cache")]


def _rank(rank: int, world: int, argv: list[str]) -> dict[str, Any]:
    """The trainer with ``argv``, saves alternating synchronous / asynchronous (``args.async_save`` flipped before
    each), its ``train_step``, ``save`` and ``settle_save`` timed: per iteration its time, whether a write was in
    flight at its start and which save it made; per save the seconds until its marker was written."""
    from ds_wallfacer.train import manifest
    from ds_wallfacer.train.cli import parse_args
    from ds_wallfacer.train.trainer import Trainer

    t = Trainer(parse_args(argv))
    t.build()
    t.resume()
    t.start()
    starts: list[float] = []
    kinds: list[str] = []
    began: dict[int, float] = {}
    marker_s: dict[str, list[float]] = {mode: [] for mode in MODES}
    train_step, save, settle = t.train_step, t.save, t.settle_save

    def timed_step() -> dict[str, Any]:
        starts.append(time.perf_counter())
        kinds.append("writing" if t.pending_save is not None else "plain")
        return train_step()

    def timed_save() -> None:
        t.args.async_save = len(began) % 2 == 1  # sync, async, sync, ...
        began[t.step] = time.perf_counter()
        kinds[-1] = MODES[int(t.args.async_save)]
        save()
        if t.pending_save is None:  # synchronous: marked before it returned
            marker_s["sync"].append(time.perf_counter() - began[t.step])

    def timed_settle(*, wait: bool) -> None:
        pending = t.pending_save
        settle(wait=wait)
        if pending is not None and t.pending_save is None:
            marker_s["async"].append(time.perf_counter() - began[pending.step])

    t.train_step, t.save, t.settle_save = timed_step, timed_save, timed_settle
    with contextlib.redirect_stdout(io.StringIO()):  # the per-step lines
        t.train()
    end = time.perf_counter()
    size = manifest.tag_bytes(t.last_ckpt) if t.last_ckpt is not None else 0
    t.engine.destroy()
    return {"iteration_s": [b - a for a, b in zip(starts, starts[1:] + [end])], "kinds": kinds,
            "marker_s": marker_s, "bytes": size, "params": t.n_params}


def _writing_after(kinds: list[str], i: int) -> list[int]:
    """The iterations right after iteration ``i`` that started with a write in flight."""
    js = []
    while i + 1 + len(js) < len(kinds) and kinds[i + 1 + len(js)] == "writing":
        js.append(i + 1 + len(js))
    return js


def _summarize(mode: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's row from every rank's timings (rank 0's iterations; the slowest rank's marker times)."""
    r = runs[0]
    its, kinds = r["iteration_s"], r["kinds"]
    plain = [s for i, (s, k) in enumerate(zip(its, kinds)) if k == "plain" and 2 <= i < len(its) - 1]
    saves = [i for i, k in enumerate(kinds) if k == mode]
    base = statistics.median(plain)
    save_s = statistics.median(its[i] for i in saves)
    after = [_writing_after(kinds, i) for i in saves]  # per save: the iterations its write was in flight at
    markers = [max(run["marker_s"][mode][j] for run in runs) for j in range(len(r["marker_s"][mode]))]
    extra = statistics.median(sum(its[j] - base for j in js) for js in after)
    return {
        "mode": mode, "step_s": base, "save_step_s": save_s, "hiccup_s": save_s - base, "saves": len(saves),
        "steps_while_writing": statistics.median(len(js) for js in after), "extra_while_writing_s": extra,
        "total_extra_s": save_s - base + extra,
        "marker_after_s": statistics.median(markers), "checkpoint_bytes": r["bytes"], "params": r["params"],
    }


def _config(out: Path, ranks: int) -> Path:
    path = out / "ds_config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2}, "steps_per_print": 100000,
        "wallfacer": {"sequence_parallel_size": ranks, "mode": "wallfacer", "ring_count": 1},
    }))
    return path


def _draw(run: dict[str, Any]) -> Any:
    def draw(plt: Any) -> Any:
        fig, ax = plt.subplots(figsize=(8, 3.5))
        its, kinds = run["iteration_s"], run["kinds"]
        steps = list(range(1, len(its) + 1))
        ax.plot(steps, its, color="gray", lw=1)
        for kind, style in (("plain", "k."), ("sync", "rs"), ("async", "bo"), ("writing", "c^")):
            pts = [(s, t) for s, t, k in zip(steps, its, kinds) if k == kind]
            if pts:
                ax.plot(*zip(*pts), style, ls="none", label=kind if kind != "writing" else "async write in flight")
        ax.set_xlabel("step")
        ax.set_ylabel("loop iteration, s")
        ax.legend(fontsize=8)
        return fig

    return draw


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    args.out = args.out.resolve()
    shutil.rmtree(args.out / "run", ignore_errors=True)
    per_rank = run_ranks(_rank, args.ranks, _trainer_argv(args, _config(args.out, args.ranks)), timeout_s=1200)
    rows = [_summarize(mode, per_rank) for mode in MODES]
    print_table([("mode", "<"), ("step s", ".3f"), ("save step s", ".3f"), ("hiccup s", ".3f"),
                 ("steps while writing", ".1f"), ("their extra s", ".3f"), ("total extra s", ".3f"),
                 ("marker after s", ".3f"), ("checkpoint MiB", ".1f")],
                [(r["mode"], r["step_s"], r["save_step_s"], r["hiccup_s"], r["steps_while_writing"],
                  r["extra_while_writing_s"], r["total_extra_s"], r["marker_after_s"], r["checkpoint_bytes"] / 2**20)
                 for r in rows],
                title=f"{args.model} ({rows[0]['params'] / 1e6:.1f}M parameters, AdamW, ZeRO-2), "
                      f"{args.ranks} CPU rank(s), seq {args.seq_len}, a save every {args.save_every} steps, "
                      f"{args.saves_per_mode} of each mode alternating (figures per save)")
    save_plot(plot_path(args, "checkpoint.png"), _draw(per_rank[0]))
    result = {"benchmark": "checkpoint", "ranks": args.ranks, "model": args.model, "seq_len": args.seq_len,
              "save_every": args.save_every, "saves_per_mode": args.saves_per_mode, "modes": rows}
    emit({**result, "iterations": {k: per_rank[0][k] for k in ("iteration_s", "kinds")}}, args.out / "result.json",
         line=result)
    shutil.rmtree(args.out / "run", ignore_errors=True)  # the checkpoints themselves are not the result
    return result


if __name__ == "__main__":
    main()
