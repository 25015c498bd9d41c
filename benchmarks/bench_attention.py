"""Benchmark WallFacer attention against plain ring attention on the same inputs.

    deepspeed --num_gpus 8 launch/bench_attention.py            # 8 CPU ranks here, 8 GPUs where present
    deepspeed --num_gpus 16 launch/bench_attention.py           # adds C = 4

Per method (ring count C, sharding), it prints: bytes sent per rank per layer by kind, forward and
backward (max over ranks; ranks with team position 0 skip the skew), the prediction of our exact formula
and of the paper's formula, causal attention work per rank (max/mean), max error against a
single-process computation of the full sequence, and the median fwd+bwd time. The last line is one JSON
object; a plot of the bytes is saved under results/.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

from ds_wallfacer.attention import AttnShape, WallFacerAttention, wallfacer_bytes
from ds_wallfacer.attention.kernels import get_kernel
from ds_wallfacer.attention.volume import paper_ring_bytes, paper_wallfacer_bytes
from ds_wallfacer.comm import KINDS, RankLayout, build_groups, valid_ring_counts
from ds_wallfacer.data import shard

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=None, help="full sequence length (default 256 * P)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA, as in the paper)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--ring-counts", default=None, help="comma list; default: 1,2 (and 4 when P >= 16)")
    ap.add_argument("--out", default="results/bench_attention.png")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return ap.parse_args()


def init() -> torch.device:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        backend, timeout = ("nccl" if cuda else "gloo"), datetime.timedelta(minutes=10)
        try:
            import deepspeed
        except ImportError:  # torchrun works too
            dist.init_process_group(backend, timeout=timeout)
        else:
            deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
    return torch.device("cuda") if cuda else torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_method(args, device, c: int, sharding: str, full, reference) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = build_groups([RankLayout(tuple(range(world)), c)])
    attn = WallFacerAttention(groups, kernel=args.kernel, sharding=sharding)
    sh = lambda x: shard(x, dim=2, index=rank, sp_size=world, scheme=sharding)  # noqa: E731
    q, k, v, do = (sh(x).contiguous() for x in full)
    times = []
    for it in range(args.iters + 1):
        ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
        attn.comm.reset()
        attn.work.clear()
        dist.barrier()
        sync(device)
        t0 = time.perf_counter()
        out = attn(ql, kl, vl, causal=True)
        out.backward(do)
        sync(device)
        times.append(time.perf_counter() - t0)
    err = max((a.double() - sh(b).double()).abs().max().item() for a, b in zip([out, ql.grad, kl.grad, vl.grad], reference))
    t = torch.tensor(times[1:], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
    stats = torch.tensor([err, attn.work["forward"]], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(gathered, stats)
    sent = {ph: attn.comm.by_kind(ph) for ph in ("forward", "backward")}
    sent_all = [None] * world
    dist.all_gather_object(sent_all, sent)
    work = [g[1].item() for g in gathered]
    return dict(
        method=f"{'ring' if c == 1 else 'wallfacer'} C={c} {sharding}", ring_count=c, sharding=sharding,
        bytes={ph: {kd: max(s[ph][kd] for s in sent_all) for kd in KINDS if kd != "check"} for ph in sent},
        bytes_rank0=sent_all[0], work_max_over_mean=max(work) / (sum(work) / world),
        max_error=max(g[0].item() for g in gathered), median_s=statistics.median(t.tolist()),
    )


def main() -> None:
    args = parse()
    device = init()
    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    n = args.seq_len or 256 * world
    hk = args.kv_heads or args.heads
    rcs = [int(x) for x in args.ring_counts.split(",")] if args.ring_counts else [1, 2] + ([4] if world >= 16 else [])
    rcs = [c for c in rcs if c in valid_ring_counts(world)]
    torch.manual_seed(0)
    gen = torch.Generator(device=device).manual_seed(0)
    full = [torch.randn(args.batch, h, n, args.head_dim, generator=gen, device=device, dtype=dtype)
            for h in (args.heads, hk, hk, args.heads)]
    # single-process reference on every rank: the same kernel on the full sequence, float32
    kern = get_kernel(args.kernel, full[0].float())
    f32 = [x.float() for x in full]
    o, lse = kern.forward(*f32[:3], causal=True, scale=args.head_dim**-0.5)
    reference = [o, *kern.backward(f32[3], *f32[:3], o, lse, causal=True, scale=args.head_dim**-0.5)]
    rows = [run_method(args, device, c, sh, full, reference) for c in rcs for sh in ("zigzag", "contiguous")]
    if rank != 0:
        return
    shape = AttnShape(args.batch, n, args.heads, hk, args.head_dim, elem_bytes=full[0].element_size())
    mb = lambda b: f"{b / 2**20:8.3f}"  # noqa: E731
    print(f"\nWallFacer attention benchmark: P={world} N={n} B={args.batch} heads={args.heads}/{hk} d={args.head_dim} "
          f"{dtype} kernel={kern.name} device={device.type}; MiB sent per rank per layer (max over ranks)")
    head = f"{'method':28s} {'phase':8s}" + "".join(f"{k:>15s}" for k in KINDS if k != "check") + f"{'ours(pred)':>12s}{'paper':>10s}"
    print(head)
    for r in rows:
        c = r["ring_count"]
        pred = wallfacer_bytes(shape, sp_size=world, ring_count=c, local=min(1, c - 1))
        paper = paper_ring_bytes(shape, sp_size=world) if c == 1 else sum(paper_wallfacer_bytes(shape, sp_size=world, ring_count=c).values())
        for ph in ("forward", "backward"):
            vals = "".join(f"{mb(r['bytes'][ph][k]):>15s}" for k in KINDS if k != "check")
            extra = f"{mb(sum(pred[ph].values())):>12s}{mb(paper) if ph == 'forward' else '':>10s}"
            print(f"{r['method']:28s} {ph:8s}{vals}{extra}")
    print(f"\n{'method':28s} {'fwd ring MiB':>12s} {'vs C=1':>7s} {'work max/mean':>14s} {'max err':>9s} {'median fwd+bwd s':>17s}")
    base = next(r for r in rows if r["ring_count"] == 1 and r["sharding"] == "zigzag")
    for r in rows:
        ratio = r["bytes"]["forward"]["ring"] / max(1, base["bytes"]["forward"]["ring"])
        print(f"{r['method']:28s} {mb(r['bytes']['forward']['ring']):>12s} {ratio:7.3f} {r['work_max_over_mean']:14.3f} "
              f"{r['max_error']:9.2e} {r['median_s']:17.4f}")
    _plot(rows, args.out)
    print(json.dumps(dict(bench="attention", P=world, N=n, batch=args.batch, heads=args.heads, kv_heads=hk,
                          head_dim=args.head_dim, dtype=str(dtype), kernel=kern.name, device=device.type,
                          methods=[{k: v for k, v in r.items() if k != "bytes_rank0"} for r in rows])))


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 4))
    kinds = [k for k in KINDS if k != "check"]
    labels = [r["method"] for r in rows if r["sharding"] == "zigzag"]
    bottom = [0.0] * len(labels)
    for kd in kinds:
        vals = [(r["bytes"]["forward"][kd] + r["bytes"]["backward"][kd]) / 2**20 for r in rows if r["sharding"] == "zigzag"]
        ax.bar(labels, vals, bottom=bottom, label=kd)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB sent per rank per layer (fwd + bwd)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"plot saved to {path}")


if __name__ == "__main__":
    main()
