"""How much of the k/v communication of ring and WallFacer attention hides behind the block kernels (measured).

    python benchmarks/bench_overlap.py                          # 4 CPU ranks (gloo, spawned), ring and C = 2
    python benchmarks/bench_overlap.py --ranks 8 --lengths 4096,8192 --iters 5

WallFacer (``attention/wallfacer.py``) starts the next ring step's k/v exchange, runs the block kernel, then waits
(``CommLayer.exchange`` returns a ``Pending``); its team exchanges (the skewed k/v gather, the team's q and the
backward's rows, the partial outputs, dq and dk/dv sent to their owners) go point to point in rounds, each waited on
only by the first call that needs it (Note [Pipelined team exchanges]). Ulysses (U = P, ``--ulysses-head-groups``)
in K head groups overlaps one group's all-to-all with another's kernels (Note [Ulysses in head groups]; K = 1: one
blocking all-to-all each way). For each method and sequence length, attention forward + backward is timed three
ways on the same inputs, the modes interleaved per iteration (a shared machine drifts):

  overlapped    as trained: the exchange in flight while the kernel runs
  serial        ``CommLayer.serial = True``: every exchange completes before it returns (same bytes, same
                results, bitwise: tests/comm/test_overlap.py)
  compute only  the time inside the block-kernel calls alone (the kernel object wrapped with a timer), from the
                serial run, where no transfer competes with it

Each figure is the slowest rank's (a step ends when the last rank ends; its blocked time is what communication added
to the step, where a faster rank's also holds its wait for the slowest), the fastest of the iterations (the least
disturbed on a shared machine; the medians are in the JSON). Reported:

  hidden = (serial - overlapped) / (serial - compute_only), clipped to [0, 1]
      serial - compute_only is everything that is not kernel time: the communication AND the local work around the
      kernels (log-sum-exp merges, team-order copies), which no overlap can hide, so this is a lower bound of the
      share of communication hidden; a negative raw value means overlapping made the step slower (on a CPU the
      transport's threads compete with the kernel for the same cores).
  hidden_vs_blocked = (serial - overlapped) / blocked_serial, clipped: the same saving over the time the serial
      run spent blocked in communication (``CommLayer.blocked_s``, the slowest rank), a direct estimate.

  blocked_ratio = blocked overlapped / blocked serial (slowest rank, fastest iteration): the share of the time
      blocked on communication that overlapping leaves. On a CPU with fewer cores than ranks a rank blocked in a
      wait also waits for its peers' turn on a core, so this is noisy;
  exposed_share = the share of the bytes moved (sent and received) in exchanges that no kernel call overlapped, from
      one recorded run (``comm.exposed_share``, Note [Which transfers are exposed]): the schedule's figure, the same
      on every run and machine.

Also the seconds blocked in communication in both modes per exchange kind (mean over ranks). Prints the tables,
writes ``runs/bench/overlap/`` (``--out``: result.json, and plot.png with matplotlib) and ends with one JSON line
holding ``blocked_ratio`` per method and length.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from harness import add_out_option, emit, plot_path, print_table, run_ranks, save_plot  # first: repository on path

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
def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict] | None:
    """Every (length, ring count) on this rank; rank 0 returns the rows, the others None."""
    import torch
    import torch.distributed as dist

    from ds_wallfacer.attention import WallFacerAttention
    from ds_wallfacer.attention.kernels import get_kernel
    from ds_wallfacer.attention.ulysses import LocalAttention, UlyssesAttention
    from ds_wallfacer.comm import CommLayer, RankLayout, build_groups, exposed_share, valid_ring_counts
    from ds_wallfacer.data import shard_sequence

    rows = []
    counts = [c for c in args.ring_counts if c in valid_ring_counts(world)]
    groups = {c: build_groups([RankLayout(tuple(range(world)), c)]) for c in counts}
    methods = [("ring C=1" if c == 1 else f"wallfacer C={c}", c) for c in counts]
    methods += [(f"ulysses K={k}", -k) for k in args.ulysses_head_groups]
    for n in args.lengths:
        gen = torch.Generator().manual_seed(n)
        full = [torch.randn(1, h, n, args.head_dim, generator=gen)
                for h in (args.heads, args.kv_heads, args.kv_heads, args.heads)]
        ring_shards = [shard_sequence(x, dim=2, index=rank, sp_size=world, scheme="zigzag").contiguous() for x in full]
        uly_shards = [shard_sequence(x, dim=2, index=rank, sp_size=world, ulysses_degree=world,
                                     scheme="zigzag").contiguous() for x in full]
        for method, c in methods:
            comm = CommLayer(device="cpu")
            q, k, v, do = ring_shards if c > 0 else uly_shards
            timed = TimedKernel(get_kernel(args.kernel, q))
            if c > 0:
                attn = WallFacerAttention(groups[c], comm=comm, kernel=args.kernel, check_inputs=False)
                attn.block_kernel = lambda *_a, _t=timed, **_kw: _t  # every block-kernel call goes through the timer
            else:
                inner = LocalAttention(args.kernel)
                inner.kernel_for = lambda *_a, _t=timed, **_kw: _t
                attn = UlyssesAttention(dist.group.WORLD, inner, comm=comm, check_inputs=False, head_groups=-c)
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
            # the schedule's figure: the share of the bytes moved in exchanges no compute overlapped (one recorded run)
            comm.serial = False
            with comm.recording() as timeline:
                ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
                attn(ql, kl, vl, causal=True).backward(do)
            share = torch.tensor([exposed_share(timeline)], dtype=torch.float64)
            dist.all_reduce(share)
            row = _summary(per_mode, blocked, sent, share.item() / world, world,
                           method=method, ring_count=max(c, 1), seq_len=n, kernel_calls=timed.calls)
            saved = row["serial_s"] - row["overlapped_s"]
            hideable = row["serial_s"] - row["compute_only_s"]
            row["hidden_raw"] = saved / hideable if hideable > 0 else float("nan")
            row["hidden"] = min(1.0, max(0.0, row["hidden_raw"])) if hideable > 0 else float("nan")
            b = row["blocked_serial_s"]
            row["blocked_ratio"] = row["blocked_overlapped_s"] / b if b > 0 else float("nan")
            row["hidden_vs_blocked_raw"] = saved / b if b > 0 else float("nan")
            row["hidden_vs_blocked"] = min(1.0, max(0.0, saved / b)) if b > 0 else float("nan")
            rows.append(row)
            if rank == 0:
                print(f"  measured {row['method']} N={n}: overlapped {row['overlapped_s']:.3f} s, serial "
                      f"{row['serial_s']:.3f} s, kernels {row['compute_only_s']:.3f} s", flush=True)
    return rows if rank == 0 else None


def _summary(per_mode: dict, blocked: dict, sent: dict, exposed_share: float, world: int, **labels) -> dict:
    """One table row from every rank's [wall, kernel, blocked] seconds per mode and iteration (``per_mode``): the
    slowest rank's fastest iteration (the least disturbed on a shared machine), medians beside it."""
    import torch
    import torch.distributed as dist

    # [iters, 3] per mode -> the slowest rank per iteration (max over ranks), then over iterations
    stats = torch.tensor([per_mode[m] for m in MODES], dtype=torch.float64)  # [modes, iters, 3]
    every = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(every, stats)
    every = torch.stack(every)  # [ranks, modes, iters, 3]
    last = every[..., 0].argmax(dim=0)  # per mode and iteration, the rank that ended last: its figures
    slowest = torch.gather(every, 0, last[None, ..., None].expand(1, *last.shape, 3))[0]
    mean = stats.clone()
    dist.all_reduce(mean)
    mean /= world
    # the fastest iteration (the least disturbed on a shared machine); medians go to the JSON as well
    best = lambda t, m, j: min(t[MODES.index(m), :, j].tolist())  # noqa: E731
    med = lambda t, m, j: statistics.median(t[MODES.index(m), :, j].tolist())  # noqa: E731
    return dict(
        **labels, P=world, exposed_share=exposed_share,
        overlapped_s=best(slowest, "overlapped", 0), serial_s=best(slowest, "serial", 0),
        compute_only_s=best(slowest, "serial", 1), compute_only_overlapped_s=best(slowest, "overlapped", 1),
        blocked_overlapped_s=best(slowest, "overlapped", 2), blocked_serial_s=best(slowest, "serial", 2),
        overlapped_median_s=med(slowest, "overlapped", 0), serial_median_s=med(slowest, "serial", 0),
        compute_only_median_s=med(slowest, "serial", 1),
        blocked_overlapped_mean_s=med(mean, "overlapped", 2), blocked_serial_mean_s=med(mean, "serial", 2),
        blocked_by_kind=_mean_by_kind(blocked, world),
        bytes_rank0=sent["overlapped"], same_bytes=sent["overlapped"] == sent["serial"],
    )


def _mean_by_kind(blocked: dict[str, list[dict]], world: int) -> dict[str, dict[str, float]]:
    """Per mode and "phase/kind": the seconds blocked, median over the iterations, mean over the ranks."""
    import torch
    import torch.distributed as dist

    from ds_wallfacer.comm import KINDS

    keys = [f"{ph}/{kd}" for ph in ("forward", "backward") for kd in KINDS]
    med = torch.tensor([[statistics.median(d.get(k, 0.0) for d in blocked[m]) for k in keys] for m in MODES],
                       dtype=torch.float64)
    dist.all_reduce(med)
    med /= world
    return {m: {k: med[i, j].item() for j, k in enumerate(keys) if med[:, j].any()} for i, m in enumerate(MODES)}


# ----------------------------------------------------------------------------------------------- report
def _report(args: argparse.Namespace, rows: list[dict], wall_s: float) -> None:
    print_table([("method", "<"), ("N", "d"), ("overlap", ".3f"), ("serial", ".3f"), ("kernels", ".3f"),
                 ("blk ovl", ".3f"), ("blk ser", ".3f"), ("hidden", ".2f"), ("(raw)", ".2f"), ("vs blk", ".2f"),
                 ("ratio", ".2f"), ("exposed", ".2f"), ("MiB/rank", ".2f")],
                [[r["method"], r["seq_len"], r["overlapped_s"], r["serial_s"], r["compute_only_s"],
                  r["blocked_overlapped_s"], r["blocked_serial_s"], r["hidden"], r["hidden_raw"],
                  r["hidden_vs_blocked"], r["blocked_ratio"], r["exposed_share"],
                  sum(r["bytes_rank0"].values()) / 2**20] for r in rows],
                title=f"\nattention fwd+bwd, P={args.ranks} CPU ranks (gloo, {args.threads} thread each), heads "
                      f"{args.heads}/{args.kv_heads}, d={args.head_dim}, fp32, kernel {args.kernel}; slowest rank, "
                      f"fastest of {args.iters}; seconds")
    print("hidden = (serial - overlapped) / (serial - kernels), clipped to [0, 1]; its denominator includes the "
          "local work around the kernels, which cannot be hidden (a lower bound). 'vs blk' = the same saving over the "
          "serial run's blocked time. blk = seconds blocked in communication (slowest rank); ratio = blk ovl / blk "
          "ser; exposed = share of the bytes moved in exchanges that no kernel call overlapped, by the schedule "
          "(mean over ranks; serial: 1).")
    kinds = sorted({k for r in rows for m in MODES for k in r["blocked_by_kind"][m]})
    print_table([("method", "<"), ("N", "d"), ("exchange", "<"), ("overlapped", ".4f"), ("serial", ".4f"),
                 ("ratio", ".2f")],
                [[r["method"], r["seq_len"], k, r["blocked_by_kind"]["overlapped"].get(k, 0.0),
                  r["blocked_by_kind"]["serial"].get(k, 0.0),
                  r["blocked_by_kind"]["overlapped"].get(k, 0.0) / r["blocked_by_kind"]["serial"][k]
                  if r["blocked_by_kind"]["serial"].get(k) else float("nan")]
                 for r in rows for k in kinds if k in r["blocked_by_kind"]["serial"]],
                title="\nseconds blocked per exchange kind (phase/kind; median over iterations, mean over ranks)")
    save_plot(plot_path(args), lambda plt: _draw(rows, plt))
    emit(dict(bench="overlap", P=args.ranks, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
              kernel=args.kernel, threads=args.threads, iters=args.iters, wall_s=round(wall_s, 1),
              blocked_ratio={m: {str(r["seq_len"]): round(r["blocked_ratio"], 3) for r in rows if r["method"] == m}
                             for m in dict.fromkeys(r["method"] for r in rows)},
              exposed_share={m: {str(r["seq_len"]): round(r["exposed_share"], 3) for r in rows if r["method"] == m}
                             for m in dict.fromkeys(r["method"] for r in rows)},
              results=[{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                        if k not in ("blocked_by_kind", "bytes_rank0")} for r in rows]),
         args.out / "result.json")


def _draw(rows: list[dict], plt):
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
    return fig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="spawned CPU ranks (gloo)")
    p.add_argument("--lengths", default="1024,2048,4096", help="full sequence lengths, comma-separated")
    p.add_argument("--ring-counts", default="1,2", help="C values; those with C*C not dividing P are skipped")
    p.add_argument("--ulysses-head-groups", default="1,2",
                   help="Ulysses (U = P) with these head-group counts K (1: one all-to-all each way); empty: none")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8, help="default: as many as query heads (the most k/v bytes)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kernel", default="cpu_flash")
    p.add_argument("--iters", type=int, default=5, help="timed iterations per mode (the fastest is reported)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    add_out_option(p, "overlap")
    args = p.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.ring_counts = [int(x) for x in args.ring_counts.split(",")]
    args.ulysses_head_groups = [int(x) for x in args.ulysses_head_groups.split(",") if x]
    bad = [n for n in args.lengths if n % (2 * args.ranks)]
    if bad:
        raise SystemExit(f"sequence lengths {bad} are not divisible by 2P = {2 * args.ranks}")
    t0 = time.time()
    got = run_ranks(_measure, args.ranks, args, timeout_s=args.timeout_s, threads=args.threads)
    if got is not None:  # None: a launcher's rank other than 0
        _report(args, got[0], time.time() - t0)

if __name__ == "__main__":
    main()
