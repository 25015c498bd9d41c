"""How much of the k/v communication of ring and WallFacer attention hides behind the block kernels (measured).

    python launch/bench_overlap.py                          # 4 CPU ranks (gloo, spawned), ring and C = 2
    python launch/bench_overlap.py --ranks 8 --lengths 4096,8192 --iters 5

WallFacer (``attention/wallfacer.py``) starts the next ring step's k/v exchange, runs the block kernel, then waits
(``CommLayer.exchange`` returns a ``Pending``). For each ring count and sequence length, attention forward +
backward is timed three ways on the same inputs, the modes interleaved per iteration (a shared machine drifts):

  overlapped    as trained: the exchange in flight while the kernel runs
  serial        ``CommLayer.serial = True``: every exchange completes before it returns (same bytes, same
                results, bitwise: tests/comm/test_overlap.py)
  compute only  the time inside the block-kernel calls alone (the kernel object wrapped with a timer), from the
                serial run, where no transfer competes with it

Each figure is the slowest rank's (a step ends when the last rank ends), the fastest of the iterations (the least
disturbed on a shared machine; the medians are in the JSON). Reported:

  hidden = (serial - overlapped) / (serial - compute_only), clipped to [0, 1]
      serial - compute_only is everything that is not kernel time: the communication AND the local work around the
      kernels (log-sum-exp merges, team-order copies), which no overlap can hide, so this is a lower bound of the
      share of communication hidden; a negative raw value means overlapping made the step slower (on a CPU the
      transport's threads compete with the kernel for the same cores).
  hidden_vs_blocked = (serial - overlapped) / blocked_serial, clipped: the same saving over the time the serial
      run spent blocked in communication (``CommLayer.blocked_s``, the slowest rank), a direct estimate.

Also the seconds blocked in communication per rank in both modes, by kind. Prints a table, saves
``runs/bench/overlap.png`` (skipped with a message without matplotlib) and ends with one JSON line.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = ("overlapped", "serial")


class TimedKernel:
    """A block kernel whose forward / backward calls add their wall time to ``seconds`` (compute-only time)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:  # name, supports_mask, supports(), ...
        return getattr(self.inner, name)

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self.inner.forward, *args, **kwargs)

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed(self.inner.backward, *args, **kwargs)


# ----------------------------------------------------------------------------------------------- one rank
def _measure(args: argparse.Namespace, rank: int, world: int) -> list[dict]:
    import torch
    import torch.distributed as dist

    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.attention.kernels import get_kernel
    from ds_wallfacer.comm import CommLayer, RankLayout, build_groups, valid_ring_counts
    from ds_wallfacer.data import shard

    rows = []
    counts = [c for c in args.ring_counts if c in valid_ring_counts(world)]
    groups = {c: build_groups([RankLayout(tuple(range(world)), c)]) for c in counts}
    for n in args.lengths:
        gen = torch.Generator().manual_seed(n)
        q, do = (torch.randn(1, args.heads, n, args.head_dim, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, args.kv_heads, n, args.head_dim, generator=gen) for _ in range(2))
        q, k, v, do = (shard(x, dim=2, index=rank, sp_size=world, scheme="zigzag").contiguous() for x in (q, k, v, do))
        for c in counts:
            comm = CommLayer(device="cpu")
            attn = WallFacerAttention(groups[c], comm=comm, kernel=args.kernel, check_inputs=False)
            timed = TimedKernel(get_kernel(args.kernel, q))
            attn.block_kernel = lambda *_a, _t=timed, **_kw: _t  # every block-kernel call goes through the timer
            per_mode: dict[str, list[list[float]]] = {m: [] for m in MODES}
            blocked: dict[str, list[dict]] = {m: [] for m in MODES}
            sent: dict[str, dict] = {}
            for it in range(args.warmup + args.iters):
                for mode in MODES:
                    comm.serial = mode == "serial"
                    comm.reset()
                    timed.seconds = 0.0
                    ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
                    dist.barrier()
                    t0 = time.perf_counter()
                    out = attn(ql, kl, vl, causal=True)
                    out.backward(do)
                    wall = time.perf_counter() - t0
                    if it < args.warmup:
                        continue
                    wait = sum(comm.blocked_s.values())
                    per_mode[mode].append([wall, timed.seconds, wait])
                    blocked[mode].append({f"{ph}/{kd}": s for (ph, kd), s in comm.blocked_s.items()})
                    sent[mode] = {f"{ph}/{kd}": b for (ph, kd), b in comm.sent.items()}
            # [iters, 3] per mode -> the slowest rank per iteration (max over ranks), then over iterations
            stats = torch.tensor([per_mode[m] for m in MODES], dtype=torch.float64)  # [modes, iters, 3]
            slowest = stats.clone()
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            mean = stats.clone()
            dist.all_reduce(mean)
            mean /= world
            # the fastest iteration (the least disturbed on a shared machine); medians go to the JSON as well
            best = lambda t, m, j: min(t[MODES.index(m), :, j].tolist())  # noqa: E731
            med = lambda t, m, j: statistics.median(t[MODES.index(m), :, j].tolist())  # noqa: E731
            row = dict(
                method="ring C=1" if c == 1 else f"wallfacer C={c}", ring_count=c, seq_len=n, P=world,
                overlapped_s=best(slowest, "overlapped", 0), serial_s=best(slowest, "serial", 0),
                compute_only_s=best(slowest, "serial", 1), compute_only_overlapped_s=best(slowest, "overlapped", 1),
                blocked_overlapped_s=best(slowest, "overlapped", 2), blocked_serial_s=best(slowest, "serial", 2),
                overlapped_median_s=med(slowest, "overlapped", 0), serial_median_s=med(slowest, "serial", 0),
                compute_only_median_s=med(slowest, "serial", 1),
                blocked_overlapped_mean_s=med(mean, "overlapped", 2), blocked_serial_mean_s=med(mean, "serial", 2),
                blocked_by_kind_rank0={m: {k: statistics.median(d.get(k, 0.0) for d in blocked[m])
                                           for k in sorted({k for d in blocked[m] for k in d})} for m in MODES},
                bytes_rank0=sent["overlapped"], same_bytes=sent["overlapped"] == sent["serial"],
                kernel_calls=timed.calls,
            )
            saved = row["serial_s"] - row["overlapped_s"]
            hideable = row["serial_s"] - row["compute_only_s"]
            row["hidden_raw"] = saved / hideable if hideable > 0 else float("nan")
            row["hidden"] = min(1.0, max(0.0, row["hidden_raw"])) if hideable > 0 else float("nan")
            b = row["blocked_serial_s"]
            row["hidden_vs_blocked_raw"] = saved / b if b > 0 else float("nan")
            row["hidden_vs_blocked"] = min(1.0, max(0.0, saved / b)) if b > 0 else float("nan")
            rows.append(row)
            if rank == 0:
                print(f"  measured {row['method']} N={n}: overlapped {row['overlapped_s']:.3f} s, serial "
                      f"{row['serial_s']:.3f} s, kernels {row['compute_only_s']:.3f} s", flush=True)
    return rows


def _rank_main(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(args.threads))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
        rows = _measure(args, rank, world)
        queue.put((rank, "ok", rows if rank == 0 else None))
    except BaseException:  # noqa: BLE001 - every failure reaches the driver
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(args: argparse.Namespace) -> list[dict]:
    import queue as queue_mod

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, args.ranks, port, args, queue)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows, errors = None, []
    try:
        for _ in procs:
            rank, status, value = queue.get(timeout=args.timeout_s)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            elif rank == 0:
                rows = value
    except queue_mod.Empty:
        errors.append(f"no answer from every rank within {args.timeout_s} s")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if errors or rows is None:
        raise SystemExit("bench_overlap failed:\n" + "\n".join(errors))
    return rows


# ----------------------------------------------------------------------------------------------- report
def _report(args: argparse.Namespace, rows: list[dict], wall_s: float) -> None:
    print(f"\nattention fwd+bwd, P={args.ranks} CPU ranks (gloo, {args.threads} thread each), heads "
          f"{args.heads}/{args.kv_heads}, d={args.head_dim}, fp32, kernel {args.kernel}; slowest rank, fastest of "
          f"{args.iters}; seconds")
    head = (f"{'method':14s} {'N':>6s} {'overlap':>8s} {'serial':>8s} {'kernels':>8s} {'blk ovl':>8s} "
            f"{'blk ser':>8s} {'hidden':>7s} {'(raw)':>7s} {'vs blk':>7s} {'MiB/rank':>9s}")
    print(head)
    for r in rows:
        mib = sum(r["bytes_rank0"].values()) / 2**20
        print(f"{r['method']:14s} {r['seq_len']:6d} {r['overlapped_s']:8.3f} {r['serial_s']:8.3f} "
              f"{r['compute_only_s']:8.3f} {r['blocked_overlapped_s']:8.3f} {r['blocked_serial_s']:8.3f} "
              f"{r['hidden']:7.2f} {r['hidden_raw']:7.2f} {r['hidden_vs_blocked']:7.2f} {mib:9.2f}")
    print("hidden = (serial - overlapped) / (serial - kernels), clipped to [0, 1]; its denominator includes the "
          "local work around the kernels, which cannot be hidden (a lower bound). 'vs blk' = the same saving over the "
          "serial run's blocked time. blk = seconds blocked in communication (slowest rank).")
    _plot(rows, Path(args.plot))
    print(json.dumps(dict(bench="overlap", P=args.ranks, heads=args.heads, kv_heads=args.kv_heads,
                          head_dim=args.head_dim, kernel=args.kernel, threads=args.threads, iters=args.iters,
                          wall_s=round(wall_s, 1),
                          results=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                                    if k not in ("blocked_by_kind_rank0", "bytes_rank0")} for r in rows])))


def _plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot saved")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    methods = sorted({r["method"] for r in rows})
    fig, axes = plt.subplots(1, len(methods), figsize=(5 * len(methods), 4), squeeze=False)
    for ax, m in zip(axes[0], methods):
        mine = sorted((r for r in rows if r["method"] == m), key=lambda r: r["seq_len"])
        xs = [r["seq_len"] for r in mine]
        for key, label in (("serial_s", "serial"), ("overlapped_s", "overlapped"), ("compute_only_s", "kernels only")):
            ax.plot(xs, [r[key] for r in mine], marker="o", label=label)
        for x, r in zip(xs, mine):
            ax.annotate(f"hidden {r['hidden']:.2f}", (x, r["overlapped_s"]), textcoords="offset points",
                        xytext=(0, 8), ha="center", fontsize=8)
        ax.set_title(f"{m}, P={mine[0]['P']}")
        ax.set_xlabel("sequence length (tokens)")
        ax.set_ylabel("attention fwd+bwd, slowest rank (s)")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot saved to {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="spawned CPU ranks (gloo)")
    p.add_argument("--lengths", default="1024,2048,4096", help="full sequence lengths, comma-separated")
    p.add_argument("--ring-counts", default="1,2", help="C values; those with C*C not dividing P are skipped")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8, help="default: as many as query heads (the most k/v bytes)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kernel", default="cpu_flash")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per mode (the fastest is reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--plot", default=str(ROOT / "runs" / "bench" / "overlap.png"))
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.ring_counts = [int(x) for x in args.ring_counts.split(",")]
    bad = [n for n in args.lengths if n % (2 * args.ranks)]
    if bad:
        raise SystemExit(f"sequence lengths {bad} are not divisible by 2P = {2 * args.ranks}")
    sys.path.insert(0, str(ROOT))
    t0 = time.time()
    rows = _spawn(args)
    _report(args, rows, time.time() - t0)


if __name__ == "__main__":
    main()
