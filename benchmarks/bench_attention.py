"""Benchmark WallFacer attention against plain ring attention on the same inputs.

    deepspeed --num_gpus 8 benchmarks/bench_attention.py        # 8 CPU ranks here, 8 GPUs where present
    deepspeed --num_gpus 16 benchmarks/bench_attention.py       # adds C = 4
    python benchmarks/bench_attention.py --ranks 4              # no launcher: 4 spawned gloo CPU ranks

Per method (ring count C, sharding), it prints: bytes sent per rank per layer by kind, forward and
backward (max over ranks; ranks with team position 0 skip the skew), the prediction of our exact formula
and of the paper's formula, causal attention work per rank (max/mean), max error against a
single-process computation of the full sequence, and the median fwd+bwd time. The last line is one JSON
object, also written to ``runs/bench/attention/result.json`` (``--out``) with a plot of the bytes.
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import add_out_option, emit, plot_path, print_table, rank_device, run_ranks, save_plot  # first

import torch
import torch.distributed as dist

from ds_wallfacer.attention import AttnShape, WallFacerAttention, wallfacer_bytes
from ds_wallfacer.attention.kernels import get_kernel
from ds_wallfacer.attention.volume import paper_ring_bytes, paper_wallfacer_bytes
from ds_wallfacer.comm import KINDS, RankLayout, build_groups, valid_ring_counts
from ds_wallfacer.data import shard_sequence

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
    ap.add_argument("--ranks", type=int, default=8, help="spawned gloo CPU ranks without a launcher (under one: "
                    "the launcher's)")
    add_out_option(ap, "attention")
    ap.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed launcher
    return ap.parse_args()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_method(args, device, c: int, sharding: str, full, reference) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = build_groups([RankLayout(tuple(range(world)), c)])
    attn = WallFacerAttention(groups, kernel=args.kernel, sharding=sharding)
    sh = lambda x: shard_sequence(x, dim=2, index=rank, sp_size=world, scheme=sharding)  # noqa: E731
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


def _measure(rank: int, world: int, args: argparse.Namespace) -> dict | None:
    """Every method on this rank's shard; rank 0 returns the rows and the setup, the others None."""
    device = rank_device()
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
        return None
    return dict(rows=rows, P=world, N=n, kv_heads=hk, dtype=dtype, elem_bytes=full[0].element_size(),
                kernel=kern.name, device=device.type)


def main() -> None:
    args = parse()
    got = run_ranks(_measure, args.ranks, args)
    if got is None:  # a launcher's rank other than 0
        return
    m = got[0]
    rows, world, n, hk, dtype = m["rows"], m["P"], m["N"], m["kv_heads"], m["dtype"]
    shape = AttnShape(args.batch, n, args.heads, hk, args.head_dim, elem_bytes=m["elem_bytes"])
    mib = lambda b: b / 2**20  # noqa: E731
    kinds = [k for k in KINDS if k != "check"]
    table = []
    for r in rows:
        c = r["ring_count"]
        pred = wallfacer_bytes(shape, sp_size=world, ring_count=c, local=min(1, c - 1))
        paper = paper_ring_bytes(shape, sp_size=world) if c == 1 else sum(paper_wallfacer_bytes(shape, sp_size=world, ring_count=c).values())
        for ph in ("forward", "backward"):
            table.append([r["method"], ph, *(mib(r["bytes"][ph][k]) for k in kinds), mib(sum(pred[ph].values())),
                          mib(paper) if ph == "forward" else ""])
    print_table([("method", "<"), ("phase", "<"), *((k, ".3f") for k in kinds), ("ours(pred)", ".3f"), ("paper", ".3f")],
                table, title=f"\nWallFacer attention benchmark: P={world} N={n} B={args.batch} heads={args.heads}/{hk} "
                             f"d={args.head_dim} {dtype} kernel={m['kernel']} device={m['device']}; MiB sent per rank "
                             f"per layer (max over ranks)")
    base = next(r for r in rows if r["ring_count"] == 1 and r["sharding"] == "zigzag")
    print()
    print_table([("method", "<"), ("fwd ring MiB", ".3f"), ("vs C=1", ".3f"), ("work max/mean", ".3f"),
                 ("max err", ".2e"), ("median fwd+bwd s", ".4f")],
                [[r["method"], mib(r["bytes"]["forward"]["ring"]),
                  r["bytes"]["forward"]["ring"] / max(1, base["bytes"]["forward"]["ring"]), r["work_max_over_mean"],
                  r["max_error"], r["median_s"]] for r in rows])
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit(dict(bench="attention", P=world, N=n, batch=args.batch, heads=args.heads, kv_heads=hk,
              head_dim=args.head_dim, dtype=str(dtype), kernel=m["kernel"], device=m["device"],
              methods=[{k: v for k, v in r.items() if k != "bytes_rank0"} for r in rows]), args.out / "result.json")


def _draw(rows: list[dict], plt):
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
    return fig


if __name__ == "__main__":
    main()
