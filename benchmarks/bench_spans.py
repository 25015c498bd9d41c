"""Bidirectional spans (Gemma 3's images, PaliGemma's prefix): what a row with spans costs against the same row
causal, in bytes sent, kernel calls and score entries, per sequence-parallel mode.

    python benchmarks/bench_spans.py                          # 4 CPU ranks (gloo), 16K tokens
    python benchmarks/bench_spans.py --seq-len 4096           # a quick look

Rows (one N-token document): ``causal``, no spans (dense: the ring; C = 1 always, C = 2 when its teams send fewer
bytes); ``causal fetch``, the same row handed as one document, so that it runs the direct fetch like the rows with
spans (the baseline of the span rows' ratios); ``images``, Gemma 3-like: ``--images`` spans of 256 tokens (an
image's soft tokens) at seeded random places, text between; ``images window``, the same with the sliding window of
Gemma 3's local layers (1024); ``prefix``, PaliGemma-like: one span over the first quarter (image + prompt).

Per row: bytes all ranks sent in forward + backward and their ratio to ``causal fetch``; the bytes needed
(``volume.needed_positions`` with the spans: sent / needed is 1 on the fetch); kernel calls planned (forward; the
backward makes the same), summed over ranks, and their ratio; score entries computed, and their ratio; fwd+bwd time
of the slowest rank. The last line is one JSON object, also written to ``runs/bench/spans/result.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from harness import add_out_option, emit, print_table, run_ranks  # first: repository on path
from bench_packed import _calls_per_block, _needed_bytes, _wallfacer, modes

import torch
import torch.distributed as dist

IMAGE = 256
"""Tokens per image (Gemma 3's ``mm_tokens_per_image``)."""
WINDOW = 1024
"""Gemma 3's sliding window (its 4B-27B models)."""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="P, sequence-parallel ranks (spawned gloo processes)")
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--iters", type=int, default=1, help="timed fwd+bwd calls after one warm-up")
    ap.add_argument("--seed", type=int, default=0)
    add_out_option(ap, "spans", plot=False)
    return ap.parse_args()


def image_spans(n: int, images: int, seed: int) -> tuple[tuple[int, int], ...]:
    """``images`` disjoint spans of ``IMAGE`` tokens at seeded random places in [0, n), at least one token apart."""
    rng, spans = random.Random(seed), []
    slots = sorted(rng.sample(range(n // (IMAGE + 1)), images))
    for s in slots:
        a = s * (IMAGE + 1) + rng.randrange(0, 2)
        spans.append((a, min(n, a + IMAGE)))
    return tuple(spans)


def rows_of(n: int, args: argparse.Namespace) -> list[tuple[str, tuple | None, int | None]]:
    """(name, spans of the row (None: no documents at all), window)."""
    images = image_spans(n, args.images, args.seed)
    return [("causal", None, None), ("causal fetch", (), None), ("images", images, None),
            ("images window", images, WINDOW), ("causal fetch window", (), WINDOW), ("prefix", ((0, n // 4),), None)]


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from ds_wallfacer.attention import AttnShape
    from ds_wallfacer.attention.documents import BatchDocuments, SequenceBatch
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.data.loader import shard_sequence
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel
    from ds_wallfacer.planner.auto import ParallelSetup

    n, out = args.seq_len, []
    g = torch.Generator().manual_seed(args.seed)
    q, k, v, do = (torch.randn(1, h, n, args.head_dim, generator=g)
                   for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
    shape = AttnShape(1, n, args.heads, args.kv_heads, args.head_dim, elem_bytes=4)
    for name, mode, u, c in modes(world):
        dims = ParallelDims(world_size=world, sp_size=world, mode=mode, ulysses_degree=u, ring_count=c,
                            num_heads=args.heads, num_kv_heads=args.kv_heads)
        groups = build_sequence_parallel(ParallelSetup(dims, kernel="cpu_flash"))
        sh = lambda x: shard_sequence(x, dim=2, index=groups.shard_index, sp_size=world,  # noqa: E731
                                      ulysses_degree=u, scheme="zigzag").contiguous()
        ql, kl, vl, dol = (sh(x) for x in (q, k, v, do))
        for row, spans, window in rows_of(n, args):
            batch = None if spans is None else SequenceBatch(documents=BatchDocuments(
                starts=((0,),), seq_len=n, spans=(spans,)))
            attn = attention_for(groups, comm=CommLayer())
            wf = _wallfacer(attn)
            times = []
            for it in range(args.iters + 1):
                wf.work.clear()
                wf.comm.sent.clear()
                a, b, c_ = (x.clone().requires_grad_() for x in (ql, kl, vl))
                dist.barrier()
                t0 = time.perf_counter()
                attn(a, b, c_, causal=True, batch=batch, window=window).backward(dol)
                dist.barrier()
                if it:
                    times.append(time.perf_counter() - t0)
            sched = next(iter(wf._schedules.values()))[1]
            calls, blocks = _calls_per_block(sched)
            sent = sum(x for ph in ("forward", "backward") for kd, x in wf.comm.by_kind(ph).items() if kd != "check")
            out.append(dict(mode=name, row=row, window=window, spans=len(spans or ()), sent=sent, calls=calls,
                            blocks=blocks, work=wf.work["forward"], time_s=statistics.median(times),
                            needed=_needed_bytes(attn, batch, window, shape, u), path=type(sched).__name__))
    return out


def _rows(per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for i, first in enumerate(per_rank[0]):
        mine = [r[i] for r in per_rank]
        rows.append(dict(mode=first["mode"], row=first["row"], spans=first["spans"],
                         path="fetch" if first["path"] == "FetchSchedule" else "ring",
                         bytes_sent=sum(m["sent"] for m in mine), bytes_needed=sum(m["needed"] for m in mine),
                         kernel_calls=sum(m["calls"] for m in mine), work=sum(m["work"] for m in mine),
                         time_s=max(m["time_s"] for m in mine)))
    for r in rows:  # against the same row causal on the same path (the window's own baseline for windowed rows)
        base = next(x for x in rows if x["mode"] == r["mode"] and x["row"] == (
            "causal fetch window" if "window" in r["row"] else "causal fetch"))
        for key in ("bytes_sent", "kernel_calls", "work"):
            r[f"{key}_vs_causal"] = r[key] / base[key]
    return rows


def main() -> None:
    args = parse()
    per_rank = run_ranks(_measure, args.ranks, args, timeout_s=3600)
    if per_rank is None:  # a launcher's rank other than 0
        return
    rows = _rows(per_rank)
    print_table([("mode", "<"), ("row", "<"), ("spans", "d"), ("path", "<"), ("bytes sent", "d"),
                 ("vs causal", ".4f"), ("sent/needed", ".3f"), ("kernel calls", "d"), ("vs causal", ".2f"),
                 ("score entries", "d"), ("vs causal", ".4f"), ("fwd+bwd s", ".3f")],
                [[r["mode"], r["row"], r["spans"], r["path"], r["bytes_sent"], r["bytes_sent_vs_causal"],
                  r["bytes_sent"] / r["bytes_needed"] if r["bytes_needed"] else float("nan"), r["kernel_calls"],
                  r["kernel_calls_vs_causal"], r["work"], r["work_vs_causal"], r["time_s"]] for r in rows],
                title=f"P = {len(per_rank)}, N = {args.seq_len}, {args.heads}/{args.kv_heads} heads, "
                      f"d = {args.head_dim}, fp32, cpu_flash, zigzag")
    emit({"bench": "spans", "sp_size": len(per_rank), "seq_len": args.seq_len, "rows": rows}, args.out /
         "result.json", line={"bench": "spans", "rows": [
             {k: r[k] for k in ("mode", "row", "path", "bytes_sent", "bytes_sent_vs_causal", "kernel_calls",
                                "kernel_calls_vs_causal", "work_vs_causal")} for r in rows]})


if __name__ == "__main__":
    main()
