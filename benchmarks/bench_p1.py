"""WallFacer attention on one rank (P = 1) against its own bare block kernel: what the ring machinery costs.

    python benchmarks/bench_p1.py                                  # CUDA: 16K and 128K tokens, 32/8 heads, d = 128, bf16
    python benchmarks/bench_p1.py --seq-lens 1024 --heads 8 --kv-heads 2 --head-dim 64    # CPU, small

At P = 1 WallFacer runs one causal block call per direction, so its time over the kernel's is pure overhead: the
fp32 accumulators and the log-sum-exp merge, the final weighting, gradient accumulation, and the collectives of
a one-rank group. Both are timed in this one process, interleaved (kernel, WallFacer, kernel, ...), fwd+bwd,
median of ``--iters`` after a warm-up. Prints a table (ratio = WallFacer / kernel; the target is <= 1.03) and a
last JSON line, also written to ``runs/bench/p1/result.json`` (``--out``) and to ``--json``. Needs no launcher: it
opens a one-rank process group itself.
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import add_out_option, emit, init_one_rank, print_table  # first: the repository on sys.path

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default=None, help="comma list (default 16384,131072 on CUDA, 1024 on CPU)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the JSON result here")
    add_out_option(ap, "p1", plot=False)
    return ap.parse_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(args: argparse.Namespace, n: int, device: torch.device, dtype: torch.dtype) -> dict:
    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.comm import RankLayout, build_groups

    attn = WallFacerAttention(build_groups([RankLayout((0,), 1)]), kernel=args.kernel)
    g = torch.Generator(device=device).manual_seed(0)
    q, do = (torch.randn(1, args.heads, n, args.head_dim, generator=g, device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(1, args.kv_heads, n, args.head_dim, generator=g, device=device, dtype=dtype) for _ in range(2))
    scale = args.head_dim**-0.5
    kern = attn.block_kernel(q)  # the kernel WallFacer itself calls

    def bare():
        out, lse = kern.forward(q, k, v, causal=True, scale=scale)
        grads = kern.backward(do, q, k, v, out, lse, causal=True, scale=scale)
        return out, grads

    def wallfacer():
        ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
        out = attn(ql, kl, vl, causal=True, scale=scale)
        out.backward(do)
        return out.detach(), (ql.grad, kl.grad, vl.grad)

    def timed(fn) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    o_b, g_b = bare()  # warm-up of both (first calls compile / plan), and their agreement
    o_w, g_w = wallfacer()
    err = max((a.float() - b.float()).abs().max().item() for a, b in zip([o_w, *g_w], [o_b, *g_b]))
    del o_b, g_b, o_w, g_w
    t_bare, t_wf = [], []
    for _ in range(args.iters):
        t_bare.append(timed(bare))
        t_wf.append(timed(wallfacer))
    sb, sw = statistics.median(t_bare), statistics.median(t_wf)
    flops = 4 * 3.5 * n * n * args.heads * args.head_dim * 0.5  # causal fwd + bwd
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return dict(seq_len=n, kernel=kern.name, kernel_ms=sb * 1e3, wallfacer_ms=sw * 1e3, ratio=sw / sb,
                kernel_tflops=flops / sb / 1e12, wallfacer_tflops=flops / sw / 1e12, max_abs_diff=err)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    seqs = [int(x) for x in (args.seq_lens or ("16384,131072" if cuda else "1024")).split(",")]
    init_one_rank(device.type)
    from ds_wallfacer.attention.merge import triton_merge_available

    rows = []
    for n in seqs:
        try:
            rows.append(measure(args, n, device, dtype))
        except torch.OutOfMemoryError as e:
            rows.append(dict(seq_len=n, failed=f"out of memory: {e}"[:200]))
            torch.cuda.empty_cache()
    ok = [r for r in rows if "failed" not in r]
    print_table([("seq", "d"), ("kernel", "<"), ("kernel ms", ".2f"), ("WallFacer ms", ".2f"), ("ratio", ".3f"),
                 ("kernel TFLOP/s", ".1f"), ("max diff", ".2e")],
                [[r["seq_len"], r["kernel"], r["kernel_ms"], r["wallfacer_ms"], r["ratio"], r["kernel_tflops"],
                  r["max_abs_diff"]] for r in ok],
                title=f"\nWallFacer P = 1 vs its bare block kernel on {device} ({dtype}, heads {args.heads}/"
                      f"{args.kv_heads}, head dim {args.head_dim}, causal, fwd+bwd, median of {args.iters}; Triton "
                      f"merge available: {triton_merge_available()})")
    for r in rows:
        if "failed" in r:
            print(f"{r['seq_len']:7d} FAILED {r['failed']}")
    result = dict(bench="p1_overhead", device=str(device), dtype=str(dtype).replace("torch.", ""), heads=args.heads,
                  kv_heads=args.kv_heads, head_dim=args.head_dim, triton_merge=triton_merge_available(), rows=rows)
    emit(result, args.out / "result.json", args.json)
    return result


if __name__ == "__main__":
    main()
    if dist.is_initialized():
        dist.destroy_process_group()
