"""Packed documents and sliding windows: bytes sent against the bytes needed, kernel calls per block, work balance
and time, per sequence-parallel mode and sharding, on the same inputs.

    python benchmarks/bench_packed.py                             # 4 CPU ranks (gloo), 16K and 64K tokens
    python benchmarks/bench_packed.py --seq-lens 16384 --iters 1  # a quick look

Mixes (one N-token row): ``lognormal``, document lengths log-normal (median N/64, clipped to [N/512, N/2]);
``long-tail``, many short documents (log-normal, median N/512) with one longer than a shard (1.5 N/P) among them;
``window``, one document and a sliding window of half a shard. Modes: ring (C = 1), WallFacer C = 2, the hybrid
(Ulysses U = 2 x ring); shardings: zigzag, and balanced (8 chunks per ring rank assigned by document work).

Per configuration: ``bytes/needed``, the bytes all ranks sent in forward + backward over the bytes they need
(``volume.needed_positions``: the k/v rows some query of another rank sees, counted token by token, each fetched
once forward and once backward and its dk/dv sent back once; the hybrid's all-to-alls added on both sides);
``calls/block``, kernel calls per k/v block computed (the busiest rank); work max/mean over ranks; blocks sent,
the most k/v bytes one rank sent in a forward in units of its own shard; fwd+bwd time of the slowest rank (median)
and its ratio to dense causal attention at the same N; the busiest rank's CPU time (``time.process_time``), and its
ratio to zigzag's. When the ranks outnumber the cores (4 ranks on a 2-core machine) the wall-clock time follows the
total work of all ranks, which balancing does not change; the busiest rank's CPU time is what the step takes when
every rank has its own core. Times on a shared CPU are noisy: compare within one run.
The last line is one JSON object (per configuration ``bytes_over_needed`` and ``kernel_calls_per_block``), also
written to ``runs/bench/packed/result.json`` (``--out``) beside the plot.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from harness import add_out_option, emit, plot_path, print_table, run_ranks, save_plot  # first: repository on path

import torch
import torch.distributed as dist

MODES = (("ring", "wallfacer", 1, 1), ("wallfacer C=2", "wallfacer", 1, 2), ("hybrid U=2", "hybrid", 2, 1))
"""(name, mode, U, C); those the rank count cannot hold are left out (``modes``)."""


def modes(world: int) -> tuple:
    """The ``MODES`` that ``world`` ranks can run: U divides P, a ring of at least 2 ranks beside Ulysses, and C * C
    dividing the ring dimension."""
    return tuple(m for m in MODES if world % m[2] == 0 and (m[2] == 1 or world // m[2] >= 2)
                 and (world // m[2]) % (m[3] * m[3]) == 0)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4, help="P, sequence-parallel ranks (spawned gloo processes)")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--chunks-per-rank", type=int, default=8, help="balanced sharding: chunks per ring rank")
    ap.add_argument("--iters", type=int, default=1, help="timed fwd+bwd calls after one warm-up")
    ap.add_argument("--seed", type=int, default=0)
    add_out_option(ap, "packed")
    return ap.parse_args()


def mixes(n: int, p: int, seed: int) -> dict[str, list[int] | None]:
    """Per mix, the document lengths of the row (None: one document, the ``window`` mix)."""
    from document_mix import lognormal_document_mix

    lognormal = lognormal_document_mix(seed=seed, rows=1, seq_len=n, median=n / 64, min_len=max(1, n // 512),
                                       max_len=n // 2)[0]
    rng, long = random.Random(seed), 3 * n // (2 * p)
    short = lognormal_document_mix(seed=seed + 1, rows=1, seq_len=n - long, median=n / 512, min_len=16,
                                   max_len=n // 64)[0]
    at = rng.randrange(len(short) // 4, 3 * len(short) // 4)
    return {"lognormal": lognormal, "long-tail": short[:at] + [long] + short[at:], "window": None}


def _starts(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for x in lengths[:-1]:
        out.append(out[-1] + x)
    return tuple(out)


def _wallfacer(attn):
    """The WallFacer attention inside (the hybrid's is Ulysses' inner one)."""
    return getattr(attn, "inner", attn)


def _calls_per_block(sched) -> tuple[int, int]:
    """(kernel calls, k/v blocks with at least one call) of a ring or fetch schedule."""
    from ds_wallfacer.attention.fetch import FetchSchedule

    if isinstance(sched, FetchSchedule):
        blocks = [sched.own] + [s.calls for s in sched.sources.values()]
    else:
        blocks = [[c for c in step if (c.qm, c.km) == pair] for step in sched.steps
                  for pair in {(c.qm, c.km) for c in step}]
    blocks = [b for b in blocks if b]
    return sum(len(b) for b in blocks), len(blocks)


def _needed_bytes(attn, batch, window, shape, u: int) -> int:
    """Bytes this rank needs to send (forward + backward): the fetch of what others see of its shard, dk/dv back,
    and the hybrid's all-to-alls."""
    from ds_wallfacer.attention import AttnShape, ulysses_bytes
    from ds_wallfacer.attention.documents import SequenceBatch
    from ds_wallfacer.attention.fetch import needed
    from ds_wallfacer.attention.volume import fetch_bytes

    wf = _wallfacer(attn)
    lay, r = wf.groups.layout, wf.groups.place.index
    inner = AttnShape(shape.batch, shape.seq_len, shape.q_heads // u, max(shape.kv_heads, u) // u, shape.head_dim,
                      shape.elem_bytes)
    need = needed(lay, sharding=wf.sharding, causal=True, batch=batch or SequenceBatch(), window=window,
                  local_len=shape.seq_len // lay.ring_size)
    total = sum(sum(k.values()) for k in fetch_bytes(inner, need, index=r).values())
    if u > 1:
        total += sum(sum(k.values()) for k in ulysses_bytes(shape, degree=u, sp_size=lay.ring_size * u).values())
    return total


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    from ds_wallfacer.attention import AttnShape
    from ds_wallfacer.attention.documents import BatchDocuments, SequenceBatch
    from ds_wallfacer.comm import CommLayer
    from ds_wallfacer.comm.dims import ParallelDims
    from ds_wallfacer.data.balance import balanced_assignment
    from ds_wallfacer.data.loader import shard_sequence
    from ds_wallfacer.integration.parallel import attention_for, build_sequence_parallel
    from ds_wallfacer.planner.auto import ParallelSetup

    attns = {}
    for name, mode, u, c in modes(world):
        dims = ParallelDims(world_size=world, sp_size=world, mode=mode, ulysses_degree=u, ring_count=c,
                            num_heads=args.heads, num_kv_heads=args.kv_heads)
        groups = build_sequence_parallel(ParallelSetup(dims, kernel="cpu_flash"))
        attns[name] = (groups, u)
    out = []
    for n in args.seq_lens:
        g = torch.Generator().manual_seed(args.seed)
        q, k, v, do = (torch.randn(1, h, n, args.head_dim, generator=g)
                       for h in (args.heads, args.kv_heads, args.kv_heads, args.heads))
        shape = AttnShape(1, n, args.heads, args.kv_heads, args.head_dim, elem_bytes=4)
        runs = [("ring", "dense", "zigzag")]
        for mix in ("lognormal", "long-tail"):
            runs += [(m[0], mix, s) for m in modes(world) for s in ("zigzag", "balanced")]
        runs += [("ring", "window", "zigzag")]
        all_mixes = mixes(n, world, args.seed)
        for mode, mix, sharding in runs:
            groups, u = attns[mode]
            lengths = all_mixes.get(mix)
            window = n // world // 2 if mix == "window" else None
            docs = BatchDocuments(starts=(_starts(lengths),), seq_len=n) if lengths else None
            assignment = None
            if sharding == "balanced":
                assignment = balanced_assignment([lengths], sp_size=world // u, chunks_per_rank=args.chunks_per_rank)
            batch = SequenceBatch(documents=docs, assignment=assignment) if docs or assignment else None
            attn = attention_for(groups, comm=CommLayer())
            wf = _wallfacer(attn)
            sh = lambda x: shard_sequence(x, dim=2, index=groups.shard_index, sp_size=world,  # noqa: E731
                                          ulysses_degree=u, scheme="zigzag", assignment=assignment).contiguous()
            ql, kl, vl, dol = (sh(x) for x in (q, k, v, do))
            times, cpu = [], []
            for it in range(args.iters + 1):
                wf.work.clear()
                wf.comm.sent.clear()
                a, b, c_ = (x.clone().requires_grad_() for x in (ql, kl, vl))
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                attn(a, b, c_, causal=True, batch=batch, window=window).backward(dol)
                c1 = time.process_time()
                dist.barrier()
                if it:  # the first call plans the schedule and warms up
                    times.append(time.perf_counter() - t0)
                    cpu.append(c1 - c0)
            sched = next(iter(wf._schedules.values()))[1]
            calls, blocks = _calls_per_block(sched)
            sent = {kd: wf.comm.by_kind("forward")[kd] + wf.comm.by_kind("backward")[kd]
                    for kd in wf.comm.by_kind("forward") if kd != "check"}
            kv_shard = (n // world) * args.kv_heads * 2 * args.head_dim * 4
            fwd_kv = sum(x for kd, x in wf.comm.by_kind("forward").items() if kd in ("fetch", "ring", "skew"))
            out.append(dict(n=n, mode=mode, mix=mix, sharding=sharding, docs=len(lengths) if lengths else 1,
                            work=wf.work["forward"], time_s=statistics.median(times), cpu_s=statistics.median(cpu), sent=sum(sent.values()),
                            needed=_needed_bytes(attn, batch, window, shape, u), calls=calls, blocks=blocks,
                            blocks_sent=fwd_kv / kv_shard, path=type(sched).__name__))
    return out


def _rows(per_rank: list[list[dict]]) -> list[dict]:
    rows = []
    for i, first in enumerate(per_rank[0]):
        mine = [r[i] for r in per_rank]
        work = [m["work"] for m in mine]
        sent, need = sum(m["sent"] for m in mine), sum(m["needed"] for m in mine)
        rows.append(dict(
            n=first["n"], mode=first["mode"], mix=first["mix"], sharding=first["sharding"], docs=first["docs"],
            path="fetch" if first["path"] == "FetchSchedule" else "ring",
            bytes_over_needed=sent / need if need else (0.0 if sent == 0 else float("inf")), bytes_sent=sent,
            bytes_needed=need, kernel_calls_per_block=max(m["calls"] / max(1, m["blocks"]) for m in mine),
            balance=max(work) / (sum(work) / len(work)), blocks_sent=max(m["blocks_sent"] for m in mine),
            time_s=max(m["time_s"] for m in mine), cpu_s=max(m["cpu_s"] for m in mine),
        ))
    for r in rows:
        dense = next(x for x in rows if x["n"] == r["n"] and x["mix"] == "dense")
        r["time_vs_dense"] = r["time_s"] / dense["time_s"]
    for r in rows:  # balanced against zigzag, same N, mix and mode
        z = next((x for x in rows if (x["n"], x["mix"], x["mode"], x["sharding"]) ==
                  (r["n"], r["mix"], r["mode"], "zigzag")), None)
        r["time_vs_zigzag"] = r["time_s"] / z["time_s"] if z else 1.0
        r["cpu_vs_zigzag"] = r["cpu_s"] / z["cpu_s"] if z else 1.0
    return rows


def _draw(rows: list[dict], plt):
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    packed = [r for r in rows if r["mix"] not in ("dense",)]
    names = [f"{r['n'] // 1024}K {r['mix'][:4]} {r['mode'].split()[0][:4]} {r['sharding'][:3]}" for r in packed]
    a1.bar(names, [r["bytes_over_needed"] for r in packed], color="tab:blue")
    a1.axhline(1.02, ls="--", color="k", lw=0.8)
    a1.set_ylabel("bytes sent / bytes needed")
    a2.bar(names, [r["time_vs_dense"] for r in packed], color="tab:green")
    a2.set_ylabel("fwd+bwd time / dense causal")
    for ax in (a1, a2):
        ax.tick_params(axis="x", labelsize=6, rotation=90)
    fig.tight_layout()
    return fig


def main() -> None:
    args = parse()
    per_rank = run_ranks(_measure, args.ranks, args, timeout_s=3600)
    if per_rank is None:  # a launcher's rank other than 0
        return
    rows = _rows(per_rank)
    print_table([("N", "d"), ("mix", "<"), ("docs", "d"), ("mode", "<"), ("sharding", "<"), ("path", "<"),
                 ("bytes/needed", ".3f"), ("calls/block", ".2f"), ("work max/mean", ".3f"), ("blocks sent", ".2f"),
                 ("fwd+bwd s", ".3f"), ("vs dense", ".2f"), ("vs zigzag", ".2f"), ("busiest CPU s", ".3f"),
                 ("CPU vs zigzag", ".2f")],
                [[r["n"], r["mix"], r["docs"], r["mode"], r["sharding"], r["path"], r["bytes_over_needed"],
                  r["kernel_calls_per_block"], r["balance"], r["blocks_sent"], r["time_s"], r["time_vs_dense"],
                  r["time_vs_zigzag"], r["cpu_s"], r["cpu_vs_zigzag"]] for r in rows],
                title=f"P = {len(per_rank)}, {args.heads}/{args.kv_heads} heads, d = {args.head_dim}, fp32, cpu_flash")
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit({"bench": "packed", "sp_size": len(per_rank), "seq_lens": args.seq_lens, "rows": rows}, args.out /
         "result.json", line={"bench": "packed", "configurations": [
             {k: r[k] for k in ("n", "mix", "mode", "sharding", "bytes_over_needed", "kernel_calls_per_block",
                                "time_vs_zigzag", "cpu_vs_zigzag")} for r in rows]})


if __name__ == "__main__":
    main()
