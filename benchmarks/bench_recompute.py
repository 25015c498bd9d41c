"""What keeping attention's residuals across the layer recompute saves (time, bytes, kernel calls) and costs (memory).

    python benchmarks/bench_recompute.py                               # 4 CPU ranks: ring, C = 2, Ulysses, hybrid
    python benchmarks/bench_recompute.py --checkpointing torch --no-mst --modes ring --seq-len 8192
    python benchmarks/bench_recompute.py --memory --ranks 1 --seq-len 4096 --hidden 1024 --heads 8 --kv-heads 8

A Llama-shaped model (random weights) is trained through ``ds_wallfacer.integration.initialize`` on spawned gloo CPU
ranks, the same steps three ways per mode, interleaved step by step (a shared machine drifts):

  no ckpt     decoder-layer checkpointing off (``activation_checkpointing: "none"``)
  recompute   layer checkpointing, ``keep_attention: false``: the recompute runs attention's kernels and
              communication again
  keep        layer checkpointing, ``keep_attention: true`` (the default): the recompute replays attention's kept
              output and log-sum-exp (``attention/residuals.py``)

Per step (slowest rank, median): seconds; MiB sent per rank (rank 0) in forward and backward; block-kernel calls in
forward (rank 0); the bytes attention keeps per layer between a checkpointed forward and its backward, counted
(``ResidualStats.peak_bytes`` / layers) beside ``kept_bytes_per_layer``. ``--memory`` instead runs every variant in
fresh processes and reports rank 0's peak resident memory during the steps above its resting memory after a warm-up
step (Linux ``/proc/self/clear_refs``; glibc's mmap threshold fixed so freed tensors leave the resident set), so
keep - recompute is the measured memory cost.

Prints a table, writes ``runs/bench/recompute/`` (``--out``: result.json, and plot.png with matplotlib; with
``--memory``: memory.json) and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from typing import Any

from harness import (  # first: the repository on sys.path
    add_out_option, emit, launched, plot_path, print_table, run_ranks, save_plot,
)

VARIANTS = ("no ckpt", "recompute", "keep")
# name -> "wallfacer" section (P = all ranks)
MODES = {
    "ring": {"mode": "wallfacer", "ring_count": 1},
    "wallfacer": {"mode": "wallfacer", "ring_count": 2},
    "ulysses": {"mode": "ulysses"},
    "hybrid": {"mode": "hybrid", "ulysses_degree": 2, "ring_count": 1},
    "local": {"sequence_parallel_size": 1},
}


def _model(args: argparse.Namespace):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=max(args.seq_len, 256), attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).train()


def _engine(args: argparse.Namespace, mode: str, variant: str):
    import torch

    from ds_wallfacer.integration import initialize

    ms: dict[str, Any] = {"activation_checkpointing": "none" if variant == "no ckpt" else args.checkpointing,
                          "keep_attention": variant != "recompute"}
    if args.no_mst:
        ms.update(mlp=False, lm_head=False)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True,
              "wallfacer": {**MODES[mode], "kernel": args.kernel, "mini_sequence": ms}}
    model = _model(args)
    engine, sp = initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3))
    return engine, sp


def _batch(args: argparse.Namespace, n: int, seed: int) -> dict:
    import torch

    ids = torch.randint(1, args.vocab, (1, n), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _count_kernels() -> Counter:
    """Every block kernel chosen from now on counts its forward calls."""
    from ds_wallfacer.attention import local, wallfacer

    counts: Counter = Counter()

    class Counting:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def forward(self, *a: Any, **kw: Any) -> Any:
            counts["forward"] += 1
            return self._inner.forward(*a, **kw)

    for mod in (local, wallfacer):
        orig = mod.get_kernel
        mod.get_kernel = lambda *a, _orig=orig, **kw: Counting(_orig(*a, **kw))
    return counts


def _step(engine: Any, sp: Any, batch: dict, kernels: Counter) -> dict:
    import torch
    import torch.distributed as dist

    from ds_wallfacer.attention.residuals import residual_stats

    sp.comm.reset()
    kernels.clear()
    stats = residual_stats(sp.model)
    dist.barrier()
    t0 = time.perf_counter()
    loss = engine(**sp.shard(batch))
    engine.backward(loss)
    engine.step()
    dist.barrier()
    secs = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
    dist.all_reduce(secs, op=dist.ReduceOp.MAX)
    after = residual_stats(sp.model)
    return dict(s=secs.item(), loss=loss.item(), fwd=sum(v for (ph, _), v in sp.comm.sent.items() if ph == "forward"),
                bwd=sum(v for (ph, _), v in sp.comm.sent.items() if ph == "backward"),
                kernels=kernels["forward"], peak=after.peak_bytes, stored=after.stored - stats.stored,
                missed=after.missed - stats.missed)


def _expected(args: argparse.Namespace, sp: Any) -> int:
    from ds_wallfacer.attention.residuals import kept_bytes_per_layer

    lay = sp.setup.dims
    return kept_bytes_per_layer(batch=1, local_tokens=args.seq_len // lay.ring_size, q_heads=args.heads,
                                kv_heads=args.kv_heads, head_dim=args.hidden // args.heads, elem_bytes=4,
                                ulysses_degree=lay.ulysses_degree, ring_size=lay.ring_size, ring_count=lay.ring_count)


def _time(args: argparse.Namespace, rank: int, world: int) -> list[dict]:
    kernels = _count_kernels()
    rows = []
    for mode in args.modes:
        engines = {v: _engine(args, mode, v) for v in VARIANTS}
        per: dict[str, list[dict]] = {v: [] for v in VARIANTS}
        for it in range(args.warmup + args.steps):
            order = VARIANTS[it % 3:] + VARIANTS[: it % 3]
            for v in order:
                engine, sp = engines[v]
                r = _step(engine, sp, _batch(args, args.seq_len, seed=it), kernels)
                if it >= args.warmup:
                    per[v].append(r)
        for v in VARIANTS:
            rs = per[v]
            engine, sp = engines[v]
            rows.append(dict(mode=mode, variant=v, P=sp.setup.dims.sp_size, U=sp.setup.dims.ulysses_degree,
                             C=sp.setup.dims.ring_count, step_s=statistics.median(r["s"] for r in rs),
                             fwd_mib=rs[-1]["fwd"] / 2**20, bwd_mib=rs[-1]["bwd"] / 2**20,
                             fwd_kernels=rs[-1]["kernels"], loss=rs[-1]["loss"],
                             kept_per_layer=(rs[-1]["peak"] / args.layers) if v == "keep" else 0,
                             formula_per_layer=_expected(args, sp) if v == "keep" else 0,
                             missed=sum(r["missed"] for r in rs)))
            if rank == 0:
                print(f"  {mode:9s} {v:9s} {rows[-1]['step_s']:.3f} s", flush=True)
        for engine, _ in engines.values():
            engine.destroy()
    return rows


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _memory(args: argparse.Namespace, rank: int, world: int) -> list[dict]:
    """One (mode, variant) per process: the peak resident memory of the steps above the resting memory after a
    warm-up step (Linux: the peak is reset through /proc/self/clear_refs, so start-up transients do not count)."""
    import gc

    mode, variant = args.only
    engine, sp = _engine(args, mode, variant)
    kernels = _count_kernels()
    _step(engine, sp, _batch(args, args.seq_len, seed=0), kernels)  # warm-up at full length: lazy buffers exist
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = _status_mib("VmRSS:")
    from ds_wallfacer.attention.residuals import residual_stats

    held = []
    for it in range(args.steps):
        loss = engine(**sp.shard(_batch(args, args.seq_len, seed=it + 1)))
        gc.collect()
        held.append(_status_mib("VmRSS:") - base)  # what the forward left for the backward
        engine.backward(loss)
        engine.step()
    peak = _status_mib("VmHWM:")
    kept = residual_stats(sp.model).peak_bytes
    engine.destroy()
    return [dict(mode=mode, variant=variant, P=world, rss_mib=peak - base, after_forward_mib=max(held),
                 kept_per_layer=kept / args.layers, formula_per_layer=_expected(args, sp) if variant == "keep" else 0)]


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    """The timed steps, or with ``args.only`` one variant's memory; rank 0 returns the rows, the others None."""
    rows = (_memory if args.only else _time)(args, rank, world)
    return rows if rank == 0 else None


def _ranks(args: argparse.Namespace) -> list[dict]:
    got = run_ranks(_measure, args.ranks, args, timeout_s=args.timeout_s, threads=args.threads)
    if got is None:  # a launcher's rank other than 0
        raise SystemExit(0)
    return got[0]


def _setup(args: argparse.Namespace) -> str:
    return (f"P={args.ranks} CPU ranks ({args.threads} thread each), Llama-shaped: hidden {args.hidden}, "
            f"{args.layers} layers, heads {args.heads}/{args.kv_heads}, seq {args.seq_len}, fp32, kernel "
            f"{args.kernel}, {args.checkpointing} checkpointing, MsT {'off' if args.no_mst else 'on'}")


def _report_time(args: argparse.Namespace, rows: list[dict], wall_s: float) -> dict:
    def keep(r: dict) -> dict:
        return next(x for x in rows if x["mode"] == r["mode"] and x["variant"] == "keep")

    kept = lambda r, key: r[key] / 2**20 if r["variant"] == "keep" else ""  # noqa: E731
    print_table([("mode", "<"), ("variant", "<"), ("step s", ".3f"), ("vs keep", ".3f"), ("fwd MiB", ".2f"),
                 ("bwd MiB", ".2f"), ("fwd kern", "d"), ("kept MiB/layer", ".3f"), ("formula", ".3f")],
                [[r["mode"], r["variant"], r["step_s"], r["step_s"] / keep(r)["step_s"], r["fwd_mib"], r["bwd_mib"],
                  r["fwd_kernels"], kept(r, "kept_per_layer"), kept(r, "formula_per_layer")] for r in rows],
                title=f"\none training step, {_setup(args)}; slowest rank, median of {args.steps}")
    print("vs keep = step time / the keep variant's; fwd/bwd MiB = bytes rank 0 sent per step in each phase; fwd kern "
          "= block-kernel forward calls on rank 0 per step")
    return dict(bench="recompute", setup=_setup(args), wall_s=round(wall_s, 1),
                results=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


def _report_memory(args: argparse.Namespace, rows: list[dict], wall_s: float) -> dict:
    def rec(r: dict) -> dict:
        return next(x for x in rows if x["mode"] == r["mode"] and x["variant"] == "recompute")

    def if_keep(r: dict, value: float) -> float | str:
        return value if r["variant"] == "keep" else ""

    mib = args.layers / 2**20  # per-layer bytes -> MiB over the layers
    print_table([("mode", "<"), ("variant", "<"), ("peak MiB", ".1f"), ("+keep", ".1f"), ("after fwd MiB", ".1f"),
                 ("+keep", ".1f"), ("kept MiB (counted)", ".1f"), ("formula", ".1f")],
                [[r["mode"], r["variant"], r["rss_mib"], if_keep(r, r["rss_mib"] - rec(r)["rss_mib"]),
                  r["after_forward_mib"], if_keep(r, r["after_forward_mib"] - rec(r)["after_forward_mib"]),
                  if_keep(r, r["kept_per_layer"] * mib), if_keep(r, r["formula_per_layer"] * mib)] for r in rows],
                title=f"\npeak RSS of rank 0 during {args.steps} steps above its resting RSS after a warm-up step, "
                      f"{_setup(args)}")
    print("+keep = keep - recompute; peak = the step's peak resident memory above the resting memory; after fwd = "
          "resident memory between forward and backward (what checkpointing exists to shrink)")
    return dict(bench="recompute_memory", setup=_setup(args), wall_s=round(wall_s, 1),
                results=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows])


def _draw(rows: list[dict], plt):
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, ax = plt.subplots(figsize=(1.8 * len(modes) + 2, 4))
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        ys = [next(r["step_s"] for r in rows if r["mode"] == m and r["variant"] == v) for m in modes]
        ax.bar([j + i * width for j in range(len(modes))], ys, width, label=v)
    ax.set_xticks([j + width for j in range(len(modes))], modes)
    ax.set_ylabel("step time, slowest rank (s)")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="spawned CPU ranks (gloo)")
    p.add_argument("--modes", default="ring,wallfacer,ulysses,hybrid", help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=688)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--kernel", default="cpu_flash")
    p.add_argument("--checkpointing", default="deepspeed", choices=("deepspeed", "torch"))
    p.add_argument("--no-mst", action="store_true", help="layer checkpointing alone (MLP and LM head unchunked)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per variant (median)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--memory", action="store_true", help="peak RSS per variant, fresh processes")
    p.add_argument("--timeout-s", type=float, default=3600.0)
    add_out_option(p, "recompute")
    args = p.parse_args()
    args.modes = args.modes.split(",")
    args.only = None
    if args.seq_len % (2 * args.ranks):
        raise SystemExit(f"--seq-len {args.seq_len} is not divisible by 2P = {2 * args.ranks}")
    if args.memory and launched():
        raise SystemExit("--memory measures each variant in fresh processes: run it without a launcher")
    t0 = time.time()
    if args.memory:
        # large blocks straight from mmap and back on free: resident memory then follows live tensors (glibc's
        # adaptive threshold otherwise keeps freed blocks of up to 32 MiB in the heap, and the peak RSS with them)
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
        rows = []
        for mode in args.modes:
            for v in VARIANTS:
                args.only = (mode, v)
                rows += _ranks(args)
                print(f"  {mode:9s} {v:9s} peak RSS +{rows[-1]['rss_mib']:.1f} MiB, after forward "
                      f"+{rows[-1]['after_forward_mib']:.1f} MiB", flush=True)
        emit(_report_memory(args, rows, time.time() - t0), args.out / "memory.json")
    else:
        rows = _ranks(args)
        summary = _report_time(args, rows, time.time() - t0)
        save_plot(plot_path(args), lambda plt: _draw(rows, plt))
        emit(summary, args.out / "result.json")


if __name__ == "__main__":
    main()
