"""Per-device compute calibration for the cost model: a short micro-benchmark (about 10 s on a CPU core) measures
what this device achieves on the shapes a training step runs, cached as JSON and reused.

Measured (``measure``), each at a few sizes so that efficiency against size is captured:

- ``gemm``: FLOP/s of ``x @ w`` forward + both backward matmuls (the layer's projections and MLP), against the
  FLOPs of one call;
- ``attention`` / ``attention_full``: FLOP/s of the block-attention kernel ``attention.kernels.get_kernel("auto",
  q)`` forward + backward, causal (a diagonal block) and without the mask (a ring's off-diagonal block), against
  the FLOPs of one call (forward: 2 Sq Sk h (d + dv), halved by the causal mask);
- ``op_s``: seconds of one tiny autograd op, forward + backward, in the mix a decoder layer makes (norm,
  projection, gated activation, layout copy, residual): what every op of a step costs on top of its arithmetic,
  the Python, dispatcher and autograd overhead that dominates small shapes;
- ``mem_bw``: bytes/s of a large elementwise op (the norms, rotary, activations and copies are memory-bound);
- ``adam_s_per_param``: seconds per parameter of ``torch.optim.AdamW.step`` over a flat fp32 tensor;
- ``cores``: CPU cores this process may run on (ranks beyond them share the cores).

Cache: ``$DS_WALLFACER_CACHE_DIR`` (default ``~/.cache/ds_wallfacer``) / ``calibration-<key>.json``, the key from
the device name, torch's version and the thread count. ``DS_WALLFACER_CALIBRATION=off`` disables it (the cluster
presets' datasheet FLOP/s x MFU then apply everywhere). GPU presets use a measurement only when its cache exists
(``python -m ds_wallfacer.planner --calibrate`` on that GPU writes it); the CPU preset measures on first use.
Concurrent processes on one host measure once: the first takes a file lock, the others wait and read its file.

Design: Note [Cost model] in docs/design/planner.md.
"""
from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Calibration", "cache_path", "calibrated", "device_key", "load", "load_or_measure", "measure"]

VERSION = 4
"""Bumped when what is measured changes: older cache files are measured again."""


@dataclass(frozen=True)
class Calibration:
    """What one device achieves (see the module's docstring); rates in FLOP/s, times in seconds."""

    device: str
    torch: str
    threads: int
    cores: int
    gemm: tuple[tuple[float, float], ...]
    """(FLOPs per call, FLOP/s), ascending."""
    attention: tuple[tuple[float, float], ...]
    """(FLOPs per call forward + backward, FLOP/s), ascending: causal calls (a diagonal block)."""
    op_s: float
    """One tiny autograd op, forward + backward."""
    mem_bw: float
    """Bytes read + written per second by an elementwise op over a large tensor."""
    adam_s_per_param: float
    attention_full: tuple[tuple[float, float], ...] = ()
    """The same for calls without the causal mask (ring attention's off-diagonal blocks)."""
    collective_s: tuple[tuple[float, float, float], ...] = ()
    """(ranks per core, seconds of one small all-gather, of one point-to-point exchange), gloo on this host, ranks
    per core ascending (the other ranks idle); empty on GPUs (their links' latencies are the presets')."""
    measured_s: float = 0.0
    """How long the micro-benchmark took."""
    version: int = VERSION
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def gemm_rate(self, flops_per_call: float) -> float:
        return _interp(self.gemm, flops_per_call)

    def attention_rate(self, flops_per_call: float, *, causal: bool = True) -> float:
        return _interp(self.attention if causal or not self.attention_full else self.attention_full, flops_per_call)

    def latency(self, kind: str, ranks_per_core: float) -> float:
        """Seconds per ``kind`` call ("collective" or "p2p") at ``ranks_per_core``: linear between the measured
        points, continued along the last two beyond them."""
        pts = [(r, c if kind == "collective" else p) for r, c, p in self.collective_s]
        if len(pts) == 1 or ranks_per_core <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if ranks_per_core <= x1:
                return y0 + (ranks_per_core - x0) / (x1 - x0) * (y1 - y0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return max(y1, y1 + (ranks_per_core - x1) / (x1 - x0) * (y1 - y0))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Calibration":
        d = dict(d)
        d["gemm"] = tuple(tuple(x) for x in d["gemm"])
        d["attention"] = tuple(tuple(x) for x in d["attention"])
        d["collective_s"] = tuple(tuple(x) for x in d.get("collective_s", ()))
        d["attention_full"] = tuple(tuple(x) for x in d.get("attention_full", ()))
        return cls(**d)


def _interp(table: tuple[tuple[float, float], ...], x: float) -> float:
    """The rate at size ``x``: linear in log(size) between measured sizes, the end values beyond them."""
    if x <= table[0][0]:
        return table[0][1]
    if x >= table[-1][0]:
        return table[-1][1]
    for (x0, y0), (x1, y1) in zip(table, table[1:]):
        if x0 <= x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return y0 + f * (y1 - y0)
    return table[-1][1]


# ------------------------------------------------------------------------------------------------ keys and cache
def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return "cuda " + (torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else "none")
    import platform

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu {name}"


def _threads() -> int:
    """The threads a rank computes with: ``OMP_NUM_THREADS`` when set (the launchers set it per rank), else
    torch's current count."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    import torch

    return torch.get_num_threads()


def device_key(device: str = "cpu") -> str:
    """Device name, torch version and thread count, as one file-name-safe string."""
    import torch

    raw = f"{_device_name(device)}-torch{torch.__version__}-t{_threads()}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", raw).strip("_")


def cache_dir() -> Path:
    return Path(os.environ.get("DS_WALLFACER_CACHE_DIR") or Path.home() / ".cache" / "ds_wallfacer")


def cache_path(device: str = "cpu") -> Path:
    return cache_dir() / f"calibration-{device_key(device)}.json"


def load(device: str = "cpu") -> Calibration | None:
    """The cached calibration of this device, or None (none, unreadable or of another version)."""
    path = cache_path(device)
    try:
        cal = Calibration.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return cal if cal.version == VERSION else None


def load_or_measure(device: str = "cpu", *, force: bool = False) -> Calibration:
    """The cached calibration, measured (and cached) first when there is none or ``force``."""
    if not force:
        cal = load(device)
        if cal is not None:
            return cal
    path = cache_path(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    import fcntl

    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one process per host measures; the others wait and read its result
        try:
            if not force:
                cal = load(device)
                if cal is not None:
                    return cal
            cal = measure(device)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(cal.to_json(), indent=1))
            tmp.replace(path)
            return cal
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def calibrated(cluster: Any, *, device: str | None = None) -> Any:
    """``cluster`` with this device's calibration attached (``ClusterSpec.calibration``): measured on first use for
    the CPU preset (backend gloo), read from the cache only for GPU presets; unchanged when
    ``DS_WALLFACER_CALIBRATION=off`` or nothing applies."""
    from dataclasses import replace

    if os.environ.get("DS_WALLFACER_CALIBRATION", "").lower() in ("off", "0", "false", "no"):
        return cluster
    if getattr(cluster, "calibration", None) is not None:
        return cluster
    cpu = cluster.backend == "gloo"
    if device is None:
        device = "cpu" if cpu else "cuda"
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():  # a GPU preset planned on a host without one: its datasheet figures
            return cluster
    try:
        cal = load_or_measure(device) if cpu else load(device)
    except Exception:  # noqa: BLE001 - a failed measurement leaves the datasheet figures in place
        return cluster
    return cluster if cal is None else replace(cluster, calibration=cal)


# ------------------------------------------------------------------------------------------------ the benchmark
def _timeit(fn, *, min_s: float, sync) -> float:
    """Seconds per call of ``fn``: one warm-up call, then the best of a few repeats of >= ``min_s`` / 3."""
    fn()
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    one = max(time.perf_counter() - t0, 1e-7)
    reps = max(1, int(min_s / 3 / one))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        sync()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def _gloo_worker(rank: int, world: int, port: int, sizes: list[int], iters: int, queue: Any) -> None:
    """One rank of the collective-latency measurement: per group size (the first ranks; the others wait), the
    seconds of a small all-gather and of a point-to-point exchange with both ring neighbours."""
    import torch
    import torch.distributed as dist

    from ..comm.ops import all_gather_single

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = []
    for n in sizes:
        group = dist.new_group(list(range(n)))
        if rank < n:
            x = torch.zeros(256)
            buf = torch.empty(256 * n)
            r = torch.empty(256)

            def gather():
                all_gather_single(buf, x, group=group)

            def p2p():
                ops = [dist.P2POp(dist.isend, x, (rank + 1) % n, group),
                       dist.P2POp(dist.irecv, r, (rank - 1) % n, group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

            row = [n]
            for fn in (gather, p2p):
                for _ in range(5):
                    fn()
                dist.barrier(group=group)
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn()
                row.append((time.perf_counter() - t0) / iters)
            out.append(row)
        dist.barrier()
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def _collective_latency(cores: int, iters: int = 40) -> tuple[tuple[float, float, float], ...]:
    """Small gloo collectives among 2 and among min(2 x cores, 8) processes of this host (spawned)."""
    import socket

    import torch.multiprocessing as mp

    world = max(2, min(2 * cores, 8))
    sizes = sorted({2, world})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_worker, args=(r, world, port, sizes, iters, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        rows = queue.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    return tuple((n / cores, ag, pp) for n, ag, pp in rows)


def measure(device: str = "cpu", *, budget_s: float = 6.0) -> Calibration:
    """Run the micro-benchmark on ``device`` (about ``budget_s`` seconds plus warm-ups and the gloo processes'
    start), with the threads a rank uses (``OMP_NUM_THREADS``)."""
    import torch

    t_start = time.perf_counter()
    threads, before = _threads(), torch.get_num_threads()
    torch.set_num_threads(threads)  # as the ranks run
    try:
        return _measure(device, budget_s=budget_s, t_start=t_start, threads=threads)
    finally:
        torch.set_num_threads(before)


def _measure_gemm(dev, dtype, *, scale: int, each: float, sync) -> list[tuple[float, float]]:
    """(FLOPs per matmul, FLOP/s) of forward + backward matmuls of the projections' and MLP's shapes."""
    import torch

    gemm = []
    # (tokens, in, out): the projections' and MLP's shapes from tiny to mid-size models
    for t, k, n in ((128, 128, 128), (512, 256, 688), (1024, 512, 1408), (2048, 1024, 2816)):
        t, k, n = t * scale, k * scale, n * scale
        x = torch.randn(t, k, device=dev, dtype=dtype)
        w = torch.randn(k, n, device=dev, dtype=dtype)
        g = torch.randn(t, n, device=dev, dtype=dtype)

        def run(x=x, w=w, g=g):
            y = x @ w
            _ = g @ w.t()  # dx
            _ = x.t() @ g  # dw
            return y

        s = _timeit(run, min_s=each, sync=sync)
        flops = 6.0 * t * k * n
        gemm.append((flops / 3, flops / s))  # per call: one of the three matmuls
    return gemm


def _measure_attention(dev, dtype, *, scale: int, each: float, sync):
    """(causal table, full table, kernel name): (FLOPs, FLOP/s) of the block kernel's forward + backward."""
    import torch

    from ..attention.kernels import get_kernel

    attention, attention_full = [], []
    h, d = 4, 32
    for causal, sizes, table in ((True, (128, 512, 2048), attention), (False, (128, 256, 1024), attention_full)):
        for n_tok in sizes:
            n_tok *= scale
            q = torch.randn(1, h, n_tok, d, device=dev, dtype=dtype)
            k_ = torch.randn(1, h // 2, n_tok, d, device=dev, dtype=dtype)
            v = torch.randn(1, h // 2, n_tok, d, device=dev, dtype=dtype)
            kern = get_kernel("auto", q)
            out, lse = kern.forward(q, k_, v, causal=causal, scale=d**-0.5)
            dout = torch.randn_like(out)

            def run(q=q, k_=k_, v=v, kern=kern, dout=dout, causal=causal):
                o, l_ = kern.forward(q, k_, v, causal=causal, scale=d**-0.5)
                kern.backward(dout, q, k_, v, o, l_, causal=causal, scale=d**-0.5)

            s = _timeit(run, min_s=each * 0.7, sync=sync)
            fwd = 2.0 * n_tok * n_tok * h * (d + d) / (2 if causal else 1)  # causal: half the score matrix
            total = fwd * 3.5  # backward: 2.5x forward (flash-attention's 5 matmuls vs 2)
            table.append((total, total / s))
    return attention, attention_full, kern.name


def _measure_small(dev, dtype, *, each: float, sync) -> tuple[float, float, float]:
    """(seconds per tiny op, memory bytes/s, Adam seconds per parameter)."""
    import torch

    # one tiny call, forward + backward: the kinds of ops a decoder layer makes (norm, projection, gated
    # activation, layout copy, residual) on a [4, 8] tensor, 13 ops per block
    a = torch.randn(4, 8, device=dev, requires_grad=True)
    lin = torch.nn.Linear(8, 8, device=dev)
    wn = torch.ones(8, device=dev, requires_grad=True)

    def chain():
        y = a
        for _ in range(8):
            h = y.pow(2).mean(-1, keepdim=True)
            h = wn * (y * torch.rsqrt(h + 1e-6))
            z = lin(h)
            z = torch.nn.functional.silu(z) * z
            y = y + z.transpose(0, 1).contiguous().transpose(0, 1)
        y.sum().backward()

    op_s = _timeit(chain, min_s=each, sync=sync) / (8 * 13 + 2)

    # memory-bound elementwise work (norms, rotary, activations, residuals, layout copies): bytes read + written
    # per second of an out-of-place multiply over 16 MiB
    big = torch.randn(1 << 22, device=dev, dtype=dtype)
    mem_bw = 2 * big.numel() * big.element_size() / _timeit(lambda: big * 1.0001, min_s=each / 2, sync=sync)

    p = torch.nn.Parameter(torch.randn(1 << 20, device=dev, dtype=torch.float32))
    p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW([p], lr=1e-4)
    adam = _timeit(opt.step, min_s=each, sync=sync) / p.numel()
    return op_s, mem_bw, adam


def _measure(device: str, *, budget_s: float, t_start: float, threads: int) -> Calibration:
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    scale = 8 if cuda else 1
    each = budget_s / 12
    gemm = _measure_gemm(dev, dtype, scale=scale, each=each, sync=sync)
    attention, attention_full, kernel = _measure_attention(dev, dtype, scale=scale, each=each, sync=sync)
    op_s, mem_bw, adam = _measure_small(dev, dtype, each=each, sync=sync)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    coll: tuple[tuple[float, float, float], ...] = ()
    if not cuda:
        try:  # e.g. a daemonic process may not start the gloo processes: the presets' latencies then apply
            coll = _collective_latency(cores)
        except Exception:  # noqa: BLE001 - the rest of the calibration stands (and every rank reads the same file)
            coll = ()
    return Calibration(
        device=_device_name(device), torch=torch.__version__, threads=threads, cores=cores,
        gemm=tuple(sorted(gemm)), attention=tuple(sorted(attention)), attention_full=tuple(sorted(attention_full)),
        op_s=op_s, mem_bw=mem_bw, adam_s_per_param=adam,
        collective_s=coll, measured_s=round(time.perf_counter() - t_start, 2),
        extra={"kernel": kernel, "dtype": str(dtype)},
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m ds_wallfacer.planner.calibrate [--force] [--device cuda]``: print (and cache) the calibration."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--force", action="store_true", help="measure again even when a cache exists")
    args = ap.parse_args(argv)
    cal = load_or_measure(args.device, force=args.force)
    print(json.dumps({"cache": str(cache_path(args.device)), **cal.to_json()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
