"""Block-attention kernels side by side: error against the reference and fwd+bwd speed, in one process.

    python benchmarks/bench_kernels.py                      # CPU: reference vs cpu_flash, small shapes
    python benchmarks/bench_kernels.py --seq-lens 4096,16384 # on a GPU: every CUDA backend this machine supports
    python benchmarks/bench_kernels.py --dtypes bf16 --causal only --kernels cudnn,flash_attn4 --json out.json

Every registered backend that supports the tensors runs: cuda_sdpa and cudnn with any CUDA torch, flash_attn,
flash_attn3 and flash_attn4 where installed (on the GPUs they support). Prints a table (kernel, dtype, seq len,
causal, max error of out/dq/dk/dv against the float32 reference kernel, median fwd+bwd milliseconds, TFLOP/s),
the fastest kernel per shape, and a last JSON line, also written to ``runs/bench/kernels/result.json`` (``--out``).
TFLOP/s counts 4 * 3.5 * N^2 * h * d (half of it causal):
fwd 2 matmuls, bwd 5, 2 FLOP per multiply-add.
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import add_out_option, emit, print_table  # first: the repository on sys.path

import torch

from ds_wallfacer.attention.kernels import KERNELS, get_kernel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _time(fn, device: torch.device, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", default=None, help="comma list (default 512 on CPU, 4096,16384 on CUDA)")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtypes", default=None, help="comma list of fp32,bf16,fp16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--ref-max-seq", type=int, default=8192, help="longest length checked against the reference")
    ap.add_argument("--kernels", default=None, help="comma list of backends (default: every one that runs here)")
    ap.add_argument("--causal", choices=("both", "only", "no"), default="both")
    ap.add_argument("--json", default=None, help="also write the JSON result to this file")
    add_out_option(ap, "kernels", plot=False)
    args = ap.parse_args()
    names = [n for n in KERNELS if n != "reference"] if args.kernels is None else args.kernels.split(",")
    for n in names:
        if n not in KERNELS:
            ap.error(f"unknown kernel {n!r}; choose from {list(KERNELS)}")
    causals = {"both": (True, False), "only": (True,), "no": (False,)}[args.causal]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    seqs = [int(x) for x in (args.seq_lens or ("4096,16384" if cuda else "512")).split(",")]
    hq = args.heads or (32 if cuda else 8)
    hk = args.kv_heads or (8 if cuda else 2)
    dtypes = [DTYPES[x] for x in (args.dtypes or ("bf16,fp16,fp32" if cuda else "fp32,bf16")).split(",")]
    ref = get_kernel("reference")
    rows = []
    for dtype in dtypes:
        for n in seqs:
            for causal in causals:
                g = torch.Generator(device=device).manual_seed(0)
                q, do = (torch.randn(1, hq, n, args.head_dim, generator=g, device=device, dtype=dtype) for _ in range(2))
                k, v = (torch.randn(1, hk, n, args.head_dim, generator=g, device=device, dtype=dtype) for _ in range(2))
                scale = args.head_dim**-0.5
                want = None
                if n <= args.ref_max_seq:
                    o_r, l_r = ref.forward(q, k, v, causal=causal, scale=scale)
                    want = [o_r, *ref.backward(do, q, k, v, o_r, l_r, causal=causal, scale=scale)]
                for name in names:
                    kern = KERNELS[name]()
                    if not kern.supports(q):
                        continue
                    try:
                        out, lse = kern.forward(q, k, v, causal=causal, scale=scale)
                        grads = kern.backward(do, q, k, v, out, lse, causal=causal, scale=scale)
                        err = None if want is None else max(
                            (a.float() - b.float()).abs().max().item() for a, b in zip([out, *grads], want))
                        del out, lse, grads

                        def step():
                            o, l = kern.forward(q, k, v, causal=causal, scale=scale)
                            kern.backward(do, q, k, v, o, l, causal=causal, scale=scale)

                        sec = _time(step, device, args.iters)
                    except Exception as e:  # noqa: BLE001 - a broken backend is a row, not the end of the run
                        print(f"{name} {dtype} {n} causal={causal}: FAILED {type(e).__name__}: {e}"[:400])
                        rows.append(dict(kernel=name, dtype=str(dtype).replace("torch.", ""), seq_len=n,
                                         causal=causal, max_error=None, ms=float("nan"), tflops=0.0, failed=str(e)[:200]))
                        if cuda:
                            torch.cuda.empty_cache()
                        continue
                    flops = 4 * 3.5 * n * n * hq * args.head_dim * (0.5 if causal else 1.0)  # fwd 4 + bwd 10 per 2x2
                    rows.append(dict(kernel=name, dtype=str(dtype).replace("torch.", ""), seq_len=n, causal=causal,
                                     max_error=err, ms=sec * 1e3, tflops=flops / sec / 1e12))
                if cuda:
                    torch.cuda.empty_cache()
    print_table([("kernel", "<"), ("dtype", "<"), ("seq", "d"), ("causal", ""), ("max err", ".2e"), ("ms", ".2f"),
                 ("TFLOP/s", ".1f")],
                [[r["kernel"], r["dtype"], r["seq_len"], str(r["causal"]), r["max_error"], r["ms"], r["tflops"]]
                 for r in rows],
                title=f"\nblock kernels on {device} (heads {hq}/{hk}, head dim {args.head_dim}, batch 1; fwd+bwd)")
    best = {}
    for r in rows:
        key = (r["dtype"], r["seq_len"], r["causal"])
        if r["tflops"] > best.get(key, {}).get("tflops", 0.0):
            best[key] = r
    print("fastest: " + "; ".join(f"{d} {n} causal={c}: {r['kernel']} {r['tflops']:.1f} TFLOP/s"
                                  for (d, n, c), r in best.items()))
    emit(dict(bench="kernels", device=str(device), device_name=torch.cuda.get_device_name() if cuda else "cpu",
              heads=hq, kv_heads=hk, head_dim=args.head_dim, rows=rows), args.out / "result.json", args.json)


if __name__ == "__main__":
    main()
