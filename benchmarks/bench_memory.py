"""Peak memory and step time of one training step at increasing sequence lengths (docs/design/dependencies.md).

Methods, all on the same Llama-shaped HF model (random weights), one step = forward, backward, optimizer:
  hf        plain HF (full logits, no checkpointing)
  hf_ckpt   HF + activation checkpointing (torch, non-reentrant)
  alst      DeepSpeed ALST tiling: TiledMLP + TiledFusedLogitsLoss (deepspeed.runtime.sequence_parallel.ulysses_sp)
            + activation checkpointing
  ours      ds_wallfacer.mst: mini-sequence MLP + LM head, DeepSpeed activation checkpointing

CPU: every (method, length) runs in a fresh process; memory = ru_maxrss of the step minus ru_maxrss after a warm-up
step at 16 tokens (the model's own: parameters, gradients, optimizer states); --budget-gib bounds this activation
memory. Resident memory also moves with the allocator (freed heap kept) and with library pages evicted and faulted
back on a busy machine (the same method measured 0.18 and 0.30 GiB at 2K in two runs), so one more forward +
backward runs under the torch profiler: "tensors" = the peak bytes of tensors alive that the step created (what
chunking and checkpointing control, exact and repeatable; the optimizer's own temporaries excluded). A method stops at the first length over budget, or before a length whose memory, projected linearly from the
last two lengths, is over budget (activation memory is linear in S with SDPA attention; saves the slowest runs). CUDA: one process per method, torch.cuda.max_memory_allocated per length (resettable), a method
stops at the first out-of-memory or when the next step would exceed --max-step-s.

Prints a table, writes ``runs/bench/memory/`` (``--out``: <preset>_<dtype>_<device>.json, and .png with
matplotlib), and prints one JSON object as the last line.
  python benchmarks/bench_memory.py                              # CPU default, about 15-20 min on 2 cores
  python benchmarks/bench_memory.py --preset llama3-8b --dtype bf16 --device cuda
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from harness import (  # first: the repository on sys.path
    ROOT, add_out_option, emit, init_one_rank, plot_path, print_table, save_plot,
)

METHODS = ("hf", "hf_ckpt", "alst", "ours")


@dataclass(frozen=True)
class Shape:
    """A Llama-style model shape."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int


PRESETS = {
    # realistic ratios (I = 3.5 d, V = 31 d as in Llama-3-8B, scaled down) sized for a 2-core CPU
    "cpu-small": Shape(hidden=1024, intermediate=3584, layers=2, heads=8, kv_heads=8, vocab=32000),
    "llama3-8b": Shape(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256),
}
DEFAULT_LENGTHS = {
    "cpu": [1024, 2048, 3072, 4096, 8192, 12288],
    "cuda": [4096, 8192, 16384, 24576, 32768, 49152, 65536, 98304, 131072, 163840, 196608],
}


# ----------------------------------------------------------------------------------------------- one step
def _build(shape: Shape, dtype, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
        max_position_embeddings=1 << 20, attn_implementation="sdpa", tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build in the target dtype: no fp32 copy of an 8B model
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.train()


def _alst_patch(model, vocab: int, logits_budget_mib: int):
    """DeepSpeed ALST tiling as its docs show it: TiledMLP per MLP and TiledFusedLogitsLoss for the head."""
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP

    def mlp_fn(mlp, x):
        return type(mlp).forward(mlp, x)

    def tiled_forward(mlp, x):
        shards = math.ceil(x.shape[-2] / x.shape[-1])  # ALST's rule: ceil(S / d)
        params = [p for p in mlp.parameters()]
        return TiledMLP.apply(mlp_fn, mlp, x, shards, params)

    for layer in model.model.layers:
        layer.mlp.forward = tiled_forward.__get__(layer.mlp)

    def loss_fn(head, x, y):
        logits = head(x).float()
        return F.cross_entropy(logits.view(-1, vocab), y.view(-1), ignore_index=-100, reduction="sum")

    def loss(ids, labels):
        hidden = model.model(input_ids=ids).last_hidden_state
        shift = F.pad(labels[..., 1:], (0, 1), value=-100)
        tokens = hidden.shape[0] * hidden.shape[1]
        shards = max(1, math.ceil(tokens * vocab * 4 / (logits_budget_mib << 20)))
        total = TiledFusedLogitsLoss.apply(
            loss_fn, model.lm_head, hidden, shift, None, shards, [model.lm_head.weight], "sum"
        )
        return total / (shift != -100).sum().clamp(min=1)

    return loss


def _make_loss(method: str, model, shape: Shape, logits_budget_mib: int):
    if method in ("hf", "hf_ckpt"):
        if method == "hf_ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return lambda ids, labels: model(input_ids=ids, labels=labels).loss
    if method == "alst":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return _alst_patch(model, shape.vocab, logits_budget_mib)
    from ds_wallfacer.mst import apply_mini_sequence, mini_sequence_lm_loss

    apply_mini_sequence(
        model, {"activation_checkpointing": "deepspeed", "lm_head_logits_budget_mib": logits_budget_mib}
    )
    return lambda ids, labels: mini_sequence_lm_loss(model, labels=labels, input_ids=ids)


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)  # KiB -> GiB (Linux)


def _tensor_peak_gib(fwd_bwd) -> float | None:
    """Peak bytes of the tensors created by ``fwd_bwd()`` that are alive at once (torch profiler memory timeline,
    CPU allocations; tensors that existed before are not counted). None when this torch has no such timeline."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import Action

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
            fwd_bwd()
        live: dict = {}
        cur = peak = 0
        for _, action, key_version, size in prof._memory_profile().timeline:
            key = key_version[0] if isinstance(key_version, tuple) else key_version
            if action == Action.CREATE:
                live[key] = size
                cur += size
            elif action == Action.DESTROY and key in live:
                cur -= live.pop(key)
            peak = max(peak, cur)
        return peak / (1 << 30)
    except Exception as e:  # noqa: BLE001 - a private torch API: report its absence, do not fail the benchmark
        print(f"tensor peak not measured: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def worker(args) -> list[dict]:
    """Run one method at the given lengths in this process; one result dict per length."""
    import torch

    torch.set_num_threads(args.threads)
    shape = PRESETS[args.preset]
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    cuda = args.device == "cuda"
    init_one_rank(args.device)  # DeepSpeed checkpointing wants deepspeed.comm up
    model = _build(shape, dtype, args.device)
    loss_fn = _make_loss(args.method, model, shape, args.logits_budget_mib)
    params = [p for p in model.parameters()]
    opt = (torch.optim.AdamW(params, lr=1e-5, fused=True) if cuda
           else torch.optim.AdamW(params, lr=1e-5, foreach=False))
    gen = torch.Generator().manual_seed(0)

    def step(seq_len: int) -> float:
        ids = torch.randint(0, shape.vocab, (1, seq_len), generator=gen).to(args.device)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = loss_fn(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of the model's own memory
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    step(16)  # warm-up: allocates gradients and optimizer states
    base = torch.cuda.memory_allocated() / (1 << 30) if cuda else _rss_gib()
    results = []
    for seq_len in args.lengths:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            times = [step(seq_len) for _ in range(args.repeats)]
        except torch.cuda.OutOfMemoryError if cuda else MemoryError:
            results.append(dict(method=args.method, seq_len=seq_len, oom=True))
            break
        peak = torch.cuda.max_memory_allocated() / (1 << 30) if cuda else _rss_gib()
        res = dict(method=args.method, seq_len=seq_len, oom=False, step_s=statistics.median(times),
                   peak_gib=peak, model_gib=base, act_gib=peak - base)
        if not cuda and args.tensor_peak:
            ids = torch.randint(0, shape.vocab, (1, seq_len), generator=gen)
            res["tensor_act_gib"] = _tensor_peak_gib(lambda: loss_fn(ids, ids).backward())
            opt.zero_grad(set_to_none=False)  # that backward's gradients are not applied
        if cuda:
            res["capacity_gib"] = torch.cuda.get_device_properties(0).total_memory / (1 << 30)
        results.append(res)
        print(json.dumps(res), flush=True)
        timed = [r for r in results if "step_s" in r]
        if cuda and seq_len != args.lengths[-1] and len(timed) >= 2:  # the first length also pays warm-up
            nxt = args.lengths[args.lengths.index(seq_len) + 1]
            (l1, t1), (l2, t2) = [(r["seq_len"], r["step_s"]) for r in timed[-2:]]
            expo = min(2.0, max(1.0, math.log(max(t2 / t1, 1.0)) / math.log(l2 / l1)))
            if t2 * (nxt / l2) ** expo > args.max_step_s:
                results.append(dict(method=args.method, seq_len=nxt, oom=False, skipped="time"))
                break
    return results


# ----------------------------------------------------------------------------------------------- driver
def _run_worker(args, method: str, lengths: list[int]) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", "--method", method, "--lengths", ",".join(map(str, lengths))]
    for k in ("preset", "dtype", "device", "threads", "repeats", "logits_budget_mib", "max_step_s"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    if not args.tensor_peak:
        cmd.append("--no-tensor-peak")
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), DS_ACCELERATOR=args.device,
               TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines or not lines[-1].startswith('{"results"'):
        if proc.returncode in (-9, 137):  # killed by the OOM killer: over the memory of this machine
            return [dict(method=method, seq_len=lengths[0], oom=True)]
        print(f"{method} at {lengths} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        done = [json.loads(l) for l in lines if '"method"' in l]  # lengths that finished before the failure
        return done + [dict(method=method, seq_len=lengths[len(done)] if len(done) < len(lengths) else lengths[-1],
                            oom=False, error=f"rc {proc.returncode}")]
    return json.loads(lines[-1])["results"]


def _max_fit(rows: list[dict], budget: float, device: str) -> int:
    ok = [r["seq_len"] for r in rows if not r.get("oom") and "act_gib" in r
          and (device == "cuda" or r["act_gib"] <= budget)]
    return max(ok, default=0)


def _extrapolate(rows: list[dict]) -> int | None:
    """CUDA: length where the peak reaches 97% of device memory, linear through the last two measured points
    (activation memory is linear in S with flash/SDPA attention); capped by a length that went out of memory."""
    ok = sorted((r["seq_len"], r["peak_gib"], r["capacity_gib"]) for r in rows if "capacity_gib" in r)
    oom = min((r["seq_len"] for r in rows if r.get("oom")), default=None)
    if len(ok) < 2 or ok[-1][1] <= ok[-2][1]:
        return None
    (l1, p1, _), (l2, p2, cap) = ok[-2], ok[-1]
    est = int(l2 + (0.97 * cap - p2) * (l2 - l1) / (p2 - p1))
    return min(est, oom) if oom else est


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="cpu-small", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--lengths", default=None, help="comma-separated sequence lengths (tokens), increasing")
    p.add_argument("--budget-gib", type=float, default=1.0,
                   help="CPU: activation-memory budget (peak minus the model's own, GiB); the default keeps the "
                        "default run near 20 min on 2 cores and under 5 GiB resident on this shared 24 GiB machine")
    p.add_argument("--logits-budget-mib", type=int, default=None,
                   help="fp32 logits per chunk, ours and alst alike (default 64 on cpu-small, else 256 = ours' default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="measured steps per length (median time)")
    p.add_argument("--max-step-s", type=float, default=60.0, help="CUDA: stop a method when the next step would "
                   "take longer (extrapolated as S^2)")
    p.add_argument("--no-tensor-peak", dest="tensor_peak", action="store_false",
                   help="CPU: skip the profiled forward + backward that measures tensor memory")
    add_out_option(p, "memory")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.logits_budget_mib is None:
        args.logits_budget_mib = 64 if args.preset == "cpu-small" else 256
    lengths = args.lengths or ",".join(map(str, DEFAULT_LENGTHS[args.device]))
    args.lengths = [int(x) for x in str(lengths).split(",")]
    if args.worker:
        print(json.dumps({"results": worker(args)}), flush=True)
        return

    shape = PRESETS[args.preset]
    methods = args.methods.split(",")
    rows: list[dict] = []
    t_start = time.time()
    for method in methods:
        if args.device == "cuda":  # peaks are resettable: one process per method
            rows += _run_worker(args, method, args.lengths)
            continue
        done: list[dict] = []
        for seq_len in args.lengths:  # ru_maxrss is not: one fresh process per configuration
            if len(done) >= 2:
                (l1, a1), (l2, a2) = [(r["seq_len"], r["act_gib"]) for r in done[-2:]]
                projected = a2 + (a2 - a1) * (seq_len - l2) / (l2 - l1)
                if projected > 1.05 * args.budget_gib:
                    rows.append(dict(method=method, seq_len=seq_len, oom=False, skipped="projected over budget",
                                     projected_act_gib=round(projected, 3)))
                    break
            r = _run_worker(args, method, [seq_len])
            rows += r
            if "act_gib" not in r[-1] or r[-1]["act_gib"] > args.budget_gib:
                break
            done.append(r[-1])
    _report(args, shape, methods, rows, time.time() - t_start)


def _report(args, shape: Shape, methods: list[str], rows: list[dict], wall_s: float) -> None:
    table: dict[str, dict[int, dict]] = {m: {} for m in methods}
    for r in rows:
        table[r["method"]][r["seq_len"]] = r
    lengths = sorted({r["seq_len"] for r in rows})
    budget = args.budget_gib
    what = "max_memory_allocated" if args.device == "cuda" else "ru_maxrss"
    tens = any(r.get("tensor_act_gib") is not None for r in rows)
    head = "peak / act / tensors / step_s" if tens else "peak / act / step_s"
    cells = []
    for L in lengths:
        row: list = [L]
        for m in methods:
            r = table[m].get(L)
            if r is None:
                row.append(None)
            elif "peak_gib" not in r:
                row.append("OOM" if r.get("oom") else f"skip: {r['skipped']}"[:30] if r.get("skipped") else "error")
            else:
                t = r.get("tensor_act_gib")
                parts = [f"{r['peak_gib']:.2f}", f"{r['act_gib']:.2f}"] + (["-" if t is None else f"{t:.3f}"] if tens else [])
                row.append(" / ".join(parts + [f"{r['step_s']:.1f}"]))
        cells.append(row)
    print_table([("seq_len", "d"), *((f"{m}: {head}", "") for m in methods)], cells,
                title=f"\nmodel {args.preset} {asdict(shape)} {args.dtype} on {args.device}; memory = {what} (GiB), "
                      f"act = minus the model's own (params + grads + AdamW states)")
    max_len = {m: _max_fit(list(table[m].values()), budget, args.device) for m in methods}
    summary: dict = dict(preset=args.preset, shape=asdict(shape), dtype=args.dtype, device=args.device,
                         budget_gib=budget if args.device == "cpu" else None, max_len=max_len, wall_s=round(wall_s))
    summary["results"] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]
    if args.device == "cuda":
        summary["max_len_extrapolated"] = {m: _extrapolate(list(table[m].values())) for m in methods}
    if "ours" in methods and "hf_ckpt" in methods and max_len["hf_ckpt"]:
        L = max_len["hf_ckpt"]
        ours, ref = table["ours"].get(L), table["hf_ckpt"][L]
        if ours and "act_gib" in ours:
            summary["ours_over_hf_ckpt_peak_at_hf_ckpt_max"] = round(ours["peak_gib"] / ref["peak_gib"], 3)
            summary["ours_over_hf_ckpt_act_at_hf_ckpt_max"] = round(ours["act_gib"] / ref["act_gib"], 3)
            summary["ours_over_hf_ckpt_step_time_at_common_max"] = round(ours["step_s"] / ref["step_s"], 3)
        summary["ours_over_hf_ckpt_max_len"] = round(max_len["ours"] / L, 2)
    for other in ("alst", "hf_ckpt"):
        if "ours" in methods and other in methods:
            pairs = [(L, table["ours"][L].get("tensor_act_gib"), table[other][L].get("tensor_act_gib"))
                     for L in lengths if L in table["ours"] and L in table[other]]
            ratios = {L: round(a / b, 3) for L, a, b in pairs if a is not None and b}
            if ratios:
                summary[f"ours_over_{other}_tensor_act_by_len"] = ratios
    if "ours" in methods and "alst" in methods and max_len["alst"]:
        summary["ours_over_alst_max_len"] = round(max_len["ours"] / max_len["alst"], 2)
        common = [L for L in lengths if "step_s" in table["ours"].get(L, {}) and "step_s" in table["alst"].get(L, {})]
        if common:
            summary["ours_over_alst_step_time_at_common_max"] = round(
                table["ours"][max(common)]["step_s"] / table["alst"][max(common)]["step_s"], 3)
    print(f"\nlongest length within budget ({'%.2f GiB activations' % budget if args.device == 'cpu' else 'device memory'}): "
          + ", ".join(f"{m} {max_len[m]}" for m in methods))
    tag = f"{args.preset}_{args.dtype}_{args.device}"
    cpu_budget = budget if args.device == "cpu" else None
    save_plot(plot_path(args, f"{tag}.png"), lambda plt: _draw(plt, table, methods, cpu_budget, tag, what))
    emit(summary, args.out / f"{tag}.json", line={k: v for k, v in summary.items() if k != "results"})


def _draw(plt, table, methods, budget, title: str, what: str):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    key = "act_gib" if budget else "peak_gib"
    for m in methods:
        pts = sorted((L, r[key]) for L, r in table[m].items() if key in r)
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=m)
    if budget:
        ax.axhline(budget, color="gray", linestyle="--", label=f"budget {budget:g} GiB")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel(f"{'activation' if budget else 'peak'} memory, {what} (GiB)")
    ax.set_title(f"one training step: {title}")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


if __name__ == "__main__":
    main()
