"""Dynamic sequence parallelism against a fixed sequence-parallel size on a long-tail length mix: the same rows,
the same optimizer steps, side by side in one run; then the planner's prediction of the same at 64 H100.

    python benchmarks/bench_dynamic_sp.py                    # 4 and 8 CPU ranks (gloo), a few minutes
    python benchmarks/bench_dynamic_sp.py --ranks 8 --steps 2

The mix: row lengths log-normal (median ``--median`` tokens, sigma ``--sigma``, at least 16), at most
``--cap`` tokens per rank, plus one row per step of P x ``--cap`` tokens (it needs every rank). Both runs train a
tiny Llama (ZeRO-2, SGD, one row per micro-batch, ``--rows`` micro-batches per step: no padding in either run):
``fixed`` shards every row over all P ranks (WallFacer ring, zigzag); ``dynamic`` gives each row the group size
``planner/dynamic.py`` chooses (``max_tokens_per_rank = --cap``) and runs many groups at once.

Per run and rank count: tokens/s (labelled tokens over the slowest rank's wall time per step, median of the steps
after the first), the busiest rank's CPU seconds per step (what a step takes when every rank has its own core; on
this 2-core machine the ranks share two), sequence-parallel bytes sent per token (all ranks, through the counted
comm layer; ZeRO's own traffic is the same in both and not counted), the mean loss over the steps, and the group
sizes dynamic chose. The prediction: Llama-3-8B on ``h100x64``, rows of 128K-1M tokens in a long-tail mix (16 per
step), fixed P = 64 against dynamic, from the planner's cost and memory models.
The last line is one JSON object, also written to ``runs/bench/dynamic_sp/result.json`` (``--out``) beside the plot.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from harness import add_out_option, emit, plot_path, print_table, run_ranks, save_plot  # first: repository on path

import torch
import torch.distributed as dist


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8], help="world sizes to run (P = the world)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is a warm-up)")
    ap.add_argument("--rows", type=int, default=16, help="rows per optimizer step")
    ap.add_argument("--median", type=int, default=96, help="median row length of the log-normal part")
    ap.add_argument("--sigma", type=float, default=0.9, help="sigma of the log-normal part")
    ap.add_argument("--cap", type=int, default=256, help="max_tokens_per_rank: a row fits a group when each rank "
                                                         "holds at most this many of its tokens")
    ap.add_argument("--seed", type=int, default=0)
    add_out_option(ap, "dynamic_sp")
    return ap.parse_args()


def lengths(args: argparse.Namespace, world: int) -> list[int]:
    """Every step's rows: ``rows - 1`` log-normal lengths (at most ``world x cap``) and one of ``world x cap``."""
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.steps):
        step = [max(16, min(world * args.cap, int(rng.lognormvariate(math.log(args.median), args.sigma))))
                for _ in range(args.rows - 1)]
        step.insert(rng.randrange(args.rows), world * args.cap)
        out.extend(step)
    return out


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=512, max_position_embeddings=8192,
                      attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).train()


def _measure(rank: int, world: int, args: argparse.Namespace) -> dict:
    from ds_wallfacer.integration import initialize

    g = torch.Generator().manual_seed(args.seed)
    rows = [{"input_ids": torch.randint(0, 512, (n,), generator=g)} for n in lengths(args, world)]
    out = {}
    for name in ("fixed", "dynamic"):
        wf = {"sequence_parallel_size": world, "mode": "wallfacer", "ring_count": 1, "self_check": False}
        if name == "dynamic":
            wf["dynamic_sequence_parallel"] = {"max_tokens_per_rank": args.cap}
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": args.rows,
                  "gradient_clipping": 0, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
                  "wallfacer": wf}
        model = _model()
        engine, sp = initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        loader = sp.dataloader(rows, shuffle=False)
        steps = iter(loader) if name == "dynamic" else _fixed_steps(loader, args.rows)
        wall, cpu, losses, sent, sizes = [], [], [], [], []
        for step in steps:
            dist.barrier()
            sp.comm.reset()
            t0, c0 = time.perf_counter(), time.process_time()
            acc = torch.zeros(1, dtype=torch.float64)
            for batch in step:
                loss = engine(**batch)
                engine.backward(loss)
                acc += float(loss.detach())
                if name == "fixed":
                    engine.step()
            if name == "dynamic":
                engine.step()
                sizes.append(step.sizes)
            c1 = time.process_time()
            dist.barrier()
            wall.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
            sent.append(sum(sp.comm.sent.values()))
            # fixed: each micro-batch's loss is its row's token mean, the step's loss their mean over the rows;
            # dynamic: each forward returns its share of the same, x W x GA (summed over all ranks)
            if name == "dynamic":
                dist.all_reduce(acc)
            losses.append(float(acc) / (args.rows * (world if name == "dynamic" else 1)))
        out[name] = dict(wall=wall, cpu=cpu, sent=sent, losses=losses, sizes=sizes)
        engine.destroy()
    return out


def _fixed_steps(loader, rows: int):
    """The fixed run's batches, ``rows`` micro-batches per step."""
    it = iter(loader)
    while True:
        step = [b for _, b in zip(range(rows), it)]
        if len(step) < rows:
            return
        yield step


def _row(name: str, world: int, per_rank: list[dict], tokens: list[int]) -> dict:
    runs = [r[name] for r in per_rank]
    steps = range(1, len(runs[0]["wall"]))  # after the warm-up
    wall = [max(r["wall"][s] for r in runs) for s in steps]
    busiest = [max(r["cpu"][s] for r in runs) for s in steps]
    sent = [sum(r["sent"][s] for r in runs) for s in steps]
    toks = [tokens[s] for s in steps]
    return dict(run=name, ranks=world, tokens_per_s=statistics.median(t / w for t, w in zip(toks, wall)),
                step_s=statistics.median(wall), busiest_cpu_s=statistics.median(busiest),
                bytes_per_token=sum(sent) / sum(toks), loss=statistics.mean(runs[0]["losses"]),
                losses=runs[0]["losses"], sizes=runs[0]["sizes"])


def predict_gpu(*, rows: int = 16, steps: int = 8, seed: int = 0) -> list[dict]:
    """Planner prediction: Llama-3-8B, 64 H100 (8 x 8), ZeRO-3 + MsT + checkpointing, bf16; rows log-normal around
    128K (sigma 0.8, 16K-1M) with one 1M row per step; fixed P = 64 (every row on all 64 ranks, one after another)
    against dynamic sizes laid out in rounds."""
    from ds_wallfacer.comm.dims import ParallelDims, dynamic_sizes, sub_dims
    from ds_wallfacer.data.steps import dynamic_rounds, round_seconds
    from ds_wallfacer.planner import Workload, get_cluster, get_model
    from ds_wallfacer.planner.dynamic import RowModel, choose_sizes, row_candidates

    model, cluster = get_model("llama3-8b"), get_cluster("h100x64")
    dims = ParallelDims(world_size=64, sp_size=64, num_heads=model.heads, num_kv_heads=model.kv_heads)
    sizes = dynamic_sizes(dims)
    rm = RowModel(model=model, cluster=cluster, workload=Workload(seq_len=128, zero_stage=3),
                  candidates=row_candidates({p: sub_dims(dims, p) for p in sizes}, mini_sequence=True,
                                            checkpointing=True))
    rng = random.Random(seed)
    fixed_s = dyn_s = tokens = 0.0
    fixed_bytes = dyn_bytes = 0.0
    chosen: list[int] = []
    for _ in range(steps):
        ns = [max(16384, min(1 << 20, int(rng.lognormvariate(math.log(131072), 0.8)) // 128 * 128))
              for _ in range(rows - 1)] + [1 << 20]
        works = [n * (n + 1) // 2 for n in ns]
        ps = choose_sizes(ns, works, model=rm, world_size=64, sp_size=64)
        chosen += ps
        secs = [rm.seconds(n, w, p) for n, w, p in zip(ns, works, ps)]
        rounds = dynamic_rounds(ps, secs, world_size=64, sp_size=64, sizes=sizes)
        dyn_s += sum(round_seconds(rounds, secs))
        fixed_s += sum(rm.seconds(n, w, 64) for n, w in zip(ns, works))
        fixed_bytes += sum(rm._cost(n, 64).step_bytes * 64 for n in ns)
        dyn_bytes += sum(rm._cost(n, p).step_bytes * p for n, p in zip(ns, ps))
        tokens += sum(ns)
    hist = {p: chosen.count(p) for p in sorted(set(chosen))}
    return [dict(run="fixed P=64", tokens_per_s=tokens / fixed_s, step_s=fixed_s / steps,
                 bytes_per_token=fixed_bytes / tokens, sizes="64 for all"),
            dict(run="dynamic", tokens_per_s=tokens / dyn_s, step_s=dyn_s / steps, bytes_per_token=dyn_bytes / tokens,
                 sizes=", ".join(f"{p}: {c}" for p, c in hist.items()))]


def _draw(rows: list[dict], plt):
    fig, ax = plt.subplots(figsize=(6, 3.5))
    worlds = sorted({r["ranks"] for r in rows})
    for i, name in enumerate(("fixed", "dynamic")):
        ax.bar([w + (i - 0.5) * 0.8 for w in worlds],
               [next(r["tokens_per_s"] for r in rows if r["ranks"] == w and r["run"] == name) for w in worlds],
               width=0.8, label=name)
    ax.set_xlabel("CPU ranks")
    ax.set_ylabel("tokens/s")
    ax.legend()
    fig.tight_layout()
    return fig


def main() -> None:
    args = parse()
    rows = []
    for world in args.ranks:
        per_rank = run_ranks(_measure, world, args, timeout_s=3600)
        if per_rank is None:
            return
        ls = lengths(args, world)
        tokens = [sum(ls[s * args.rows:(s + 1) * args.rows]) - args.rows for s in range(args.steps)]  # labelled
        fixed, dyn = _row("fixed", world, per_rank, tokens), _row("dynamic", world, per_rank, tokens)
        dyn["vs_fixed"] = dyn["tokens_per_s"] / fixed["tokens_per_s"]
        fixed["vs_fixed"] = 1.0
        rows += [fixed, dyn]
    print_table([("ranks", "d"), ("run", "<"), ("tokens/s", ".0f"), ("x fixed", ".2f"), ("step s", ".2f"),
                 ("busiest CPU s/step", ".2f"), ("SP bytes/token", ",.0f"), ("mean loss", ".5f")],
                [[r["ranks"], r["run"], r["tokens_per_s"], r["vs_fixed"], r["step_s"], r["busiest_cpu_s"],
                  r["bytes_per_token"], r["loss"]] for r in rows],
                title=f"long-tail mix: {args.rows} rows/step, median {args.median}, sigma {args.sigma}, one row of "
                      f"P x {args.cap} per step; tiny Llama, ZeRO-2, fp32")
    gpu = predict_gpu()
    gpu[1]["vs_fixed"] = gpu[1]["tokens_per_s"] / gpu[0]["tokens_per_s"]
    gpu[0]["vs_fixed"] = 1.0
    print_table([("run", "<"), ("tokens/s", ",.0f"), ("x fixed", ".2f"), ("step s", ".1f"), ("bytes/token", ",.0f"),
                 ("group sizes (rows)", "<")],
                [[r["run"], r["tokens_per_s"], r["vs_fixed"], r["step_s"], r["bytes_per_token"], r["sizes"]]
                 for r in gpu],
                title="planner prediction: Llama-3-8B on 64 H100 (h100x64), 16 rows/step of 16K-1M (log-normal around "
                      "128K, one 1M row), ZeRO-3 + MsT + checkpointing")
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit({"bench": "dynamic_sp", "cpu": rows, "gpu_prediction": gpu, "args": {k: str(v) for k, v in vars(args).items()}},
         args.out / "result.json",
         line={"bench": "dynamic_sp", "cpu": [{k: r[k] for k in ("ranks", "run", "tokens_per_s", "vs_fixed", "loss")}
                                               for r in rows],
               "gpu_prediction": [{k: r[k] for k in ("run", "tokens_per_s", "vs_fixed")} for r in gpu]})


if __name__ == "__main__":
    main()
