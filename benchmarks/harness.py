"""What every benchmark shares: its ranks, its output folder, its table, its plot and its last JSON line.

Ranks. ``run_ranks(fn, n, *args)`` runs ``fn(rank, world_size, *args)`` on every rank and hands the per-rank
results to the process that reports. Under a launcher (``deepspeed``, ``torchrun``: RANK, WORLD_SIZE and
MASTER_ADDR in the environment) it runs on the launcher's ranks, NCCL where CUDA exists, and rank 0 gets the list
(the others None); otherwise it spawns ``n`` gloo CPU ranks (``spawn_ranks``, which the tests use too) and
returns the list in this process. A rank that fails raises here with that rank's traceback.

Output. ``--out DIR`` (``add_out_option``; default ``runs/bench/<benchmark>/`` in the repository) holds what a run
writes: its JSON result and, with matplotlib installed, its plot (``--plot`` moves or turns off the plot).
People read a table (``print_table``); machines read the last line printed, the JSON result (``emit``).

No torch at import: the pure benchmarks (``bench_balance.py``) run without it.
"""
from __future__ import annotations

import argparse
import atexit
import datetime
import json
import os
import pickle
import socket
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the repository's package, also when it is not installed
    sys.path.insert(0, str(ROOT))

__all__ = [
    "ROOT", "RanksFailed", "add_job_options", "add_out_option", "emit", "free_port", "init_launched", "init_one_rank",
    "job_row", "launch_job", "launched", "run_jobs", "plot_path", "print_table", "rank_device", "remove_shm_segments",
    "run_ranks", "save_plot", "spawn_ranks",
]


# ----------------------------------------------------------------------------------------------- output
def add_out_option(parser: argparse.ArgumentParser, name: str, *, plot: bool = True) -> None:
    """``--out DIR`` (default ``runs/bench/<name>``) and, for a benchmark that draws one, ``--plot``."""
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / name,
                        help="folder of this run's JSON result and plot (default: %(default)s)")
    if plot:
        parser.add_argument("--plot", default=None, help="plot file (default: a .png in OUT), or 'none'")


def plot_path(args: argparse.Namespace, name: str = "plot.png") -> Path | None:
    """Where ``--plot`` puts the plot (default: ``name`` in ``--out``); None when it is turned off."""
    if args.plot == "none":
        return None
    return Path(args.plot) if args.plot else args.out / name


def save_plot(path: Path | None, draw: Callable[[Any], Any], *, dpi: int = 120) -> None:
    """``draw(pyplot)`` builds a figure and returns it (or None: nothing to draw), saved to ``path``. matplotlib is
    optional (the "test" extra): without it, or with ``path`` None, one line says so and the run goes on."""
    if path is None:
        print("plot: off")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot saved (pip install matplotlib)")
        return
    fig = draw(plt)
    if fig is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"plot saved to {path}")


def print_table(columns: Sequence[tuple[str, str]], rows: Iterable[Sequence[Any]], *, title: str = "") -> None:
    """A header and one line per row. ``columns``: (title, format spec of the values, e.g. ".3f", ".2e", ",d", "");
    a spec that starts with "<" left-aligns the column (text), the others are right-aligned. A cell that is a str
    is printed as it is, None as "-". Each column is as wide as its title or its widest cell."""
    cells = [[_cell(v, spec) for v, (_, spec) in zip(row, columns)] for row in rows]
    widths = [max([len(t)] + [len(r[i]) for r in cells]) for i, (t, _) in enumerate(columns)]
    left = [spec.startswith("<") for _, spec in columns]

    def line(row: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if lf else c.rjust(w) for c, w, lf in zip(row, widths, left)).rstrip()

    if title:
        print(title)
    print(line([t for t, _ in columns]))
    for r in cells:
        print(line(r))


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return format(value, spec.lstrip("<>"))


def emit(result: dict, *files: Path | str | None, line: dict | None = None) -> None:
    """Write ``result`` to each file given (indented JSON), then print ``line`` (default: ``result``) as one JSON
    line: the last line of every benchmark, the one machines read."""
    for f in files:
        if f is None:
            continue
        f = Path(f)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(json.dumps(result, indent=1))
    print(json.dumps(result if line is None else line), flush=True)


# ----------------------------------------------------------------------------------------------- ranks
class RanksFailed(AssertionError):
    """A rank raised, exited without a result, or did not finish in time. An AssertionError, so that a test
    that spawns its ranks here fails (rather than errors) with the rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_job_options(parser: argparse.ArgumentParser, *, steps: int) -> None:
    """The options of a benchmark made of launched jobs (``launch_job``): ranks, steps, threads, a time limit."""
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--job-timeout-s", type=int, default=600)


def run_jobs(args: argparse.Namespace, configurations: Iterable[dict], run: Callable[[dict, Any], dict],
             report: Callable[[Any, list[dict], float], dict]) -> int:
    """Run every configuration (``run(cfg, args)`` -> a row, with "error" when it failed), then ``report(args,
    rows, seconds)``; the exit status: 0 when no job failed."""
    import time

    t0 = time.time()
    rows = [run(cfg, args) for cfg in configurations]
    summary = report(args, rows, time.time() - t0)
    return 0 if all("error" not in r for r in summary["results"]) else 1


def launch_job(script: Path | str, ranks: int, options: Sequence[str], *, threads: int = 1,
               timeout_s: float = 600.0, cwd: Path | str | None = None) -> tuple[dict | None, str, Any]:
    """Run ``deepspeed --num_gpus ranks script *options`` (the real launcher, on a free port; ``threads`` OMP
    threads per rank) and return (the JSON summary the script printed last, or None; its output; its return code,
    or "timeout"). Its shared-memory segments are removed afterwards."""
    import subprocess

    port = free_port()
    beside = Path(sys.executable).parent / "deepspeed"  # this environment's launcher, activated or not
    cmd = [str(beside) if beside.exists() else "deepspeed", "--num_gpus", str(ranks), "--master_port", str(port),
           str(script), *map(str, options)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    # DeepSpeed's CPU op, built once per venv by launch/setup_env.sh: found there, not rebuilt in a job
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=cwd)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = str(e.stdout or ""), "timeout"
    finally:
        remove_shm_segments(port)
    lines = [ln for ln in text.splitlines() if ln.startswith("{") and '"final_loss"' in ln]
    return (json.loads(lines[-1]) if rc == 0 and lines else None), text, rc


def job_row(cfg: dict, script: Path | str, options: Callable[[str], Sequence[Any]], args: argparse.Namespace,
            *, label: str) -> dict:
    """One benchmark job: ``launch_job(script, cfg["ranks"], options(out))`` in a fresh temporary folder ``out``
    (with ``args.threads`` and ``args.job_timeout_s``) -> ``cfg`` with ``job_s`` and the job's JSON summary, or with
    ``error`` (its output's tail printed to stderr under ``label``)."""
    import tempfile
    import time

    t0 = time.time()
    with tempfile.TemporaryDirectory() as out:
        result, text, rc = launch_job(script, cfg["ranks"], options(out), threads=args.threads,
                                      timeout_s=args.job_timeout_s, cwd=out)
    row = {**cfg, "job_s": round(time.time() - t0, 1)}
    if result is None:
        tail = "\n".join(text.splitlines()[-20:])
        print(f"{label}: failed (rc {rc}):\n{tail}", file=sys.stderr)
        return {**row, "error": f"rc {rc}"}
    return {**row, **result}


def remove_shm_segments(port: int | str, rank: int | str = "*") -> None:
    """Note [DeepSpeed's CPU shared-memory buffers] (``integration/deepspeed.py``): a rank that ends before
    ``release_shm_buffer`` unlinks its ~66 MB segment leaves it in /dev/shm. This removes this user's segments of
    the run whose master port is ``port``: one rank's, or every rank's (``"*"``)."""
    for seg in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_{rank}"):
        seg.unlink(missing_ok=True)


def _rank_main(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue: Any, timeout_s: float,
               threads: int, spawned: bool) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads),
        DS_ACCELERATOR="cpu", WANDB_MODE="offline",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        # by value (plain pickle): a tensor handed over through torch's shared file descriptors can vanish with this
        # process before the parent reads it (ConnectionResetError / FileNotFoundError in the parent)
        queue.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if spawned:  # Note [A clean exit] (docs/trainer.md): this interpreter finalises (a forked one ends with _exit)
            from ds_wallfacer.integration.ds_runtime import close_distributed

            close_distributed()
        elif dist.is_initialized():
            dist.destroy_process_group()
        remove_shm_segments(port, rank)  # if ``fn`` initialised DeepSpeed without our initialize


def spawn_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0, threads: int = 1,
                start_method: str = "spawn") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local gloo CPU ranks; return the per-rank results.

    ``fn`` must be a module-level function (it is pickled by name). Each rank runs ``threads`` torch threads. A
    rank that raises makes this raise ``RanksFailed`` with that rank's traceback; a rank that hangs is killed
    after ``timeout_s`` (also the process group's timeout). ``start_method="fork"``: the ranks share the parent's
    imports (for many short launches from one parent that imported everything once).
    """
    import queue as queue_mod

    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main,
                         args=(r, world_size, port, fn, args, queue, timeout_s, threads, start_method != "fork"))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout_s + 60)
    while len(results) + len(errors) < world_size:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        try:
            rank, status, payload = queue.get(timeout=max(1.0, min(remaining, 5.0)))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results and r not in errors]
            if dead and all(not p.is_alive() for p in procs):
                for r in dead:
                    errors[r] = f"rank {r} exited with code {procs[r].exitcode} and reported nothing"
                break
            if remaining <= 0:
                break
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if errors:
        first = min(errors)
        raise RanksFailed(f"{len(errors)} of {world_size} ranks failed; rank {first}:\n{errors[first]}")
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise RanksFailed(f"ranks {missing} did not finish within {timeout_s}s (hang?)")
    return [results[r] for r in range(world_size)]


def launched() -> bool:
    """Whether this process is one rank of a launcher's job (deepspeed, torchrun)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def init_launched(*, timeout_s: float = 600.0) -> Any:
    """Join the launcher's process group (through DeepSpeed where it is installed): NCCL on this rank's GPU where
    CUDA exists, else gloo on CPU with OMP_NUM_THREADS torch threads, DeepSpeed's /dev/shm segments released once
    mapped (Note [DeepSpeed's CPU shared-memory buffers]); the groups destroyed at exit. Returns the rank's torch
    device."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if not dist.is_initialized():
        import deepspeed  # a requirement of the package; works under torchrun too

        from ds_wallfacer.integration.ds_runtime import (close_distributed, release_shm_buffer,
                                                         sweep_stale_shm_segments)

        backend, timeout = ("nccl" if cuda else "gloo"), datetime.timedelta(seconds=timeout_s)
        if not cuda:
            sweep_stale_shm_segments()  # what killed jobs left
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        # Note [A clean exit] (docs/trainer.md): the groups made here are destroyed when the benchmark ends
        atexit.unregister(close_distributed)
        atexit.register(close_distributed)
        if not cuda:  # every rank has mapped every peer's /dev/shm segment: unlink them now
            dist.barrier()
            release_shm_buffer()
    return torch.device("cuda") if cuda else torch.device("cpu")


def run_ranks(fn: Callable, ranks: int, *args: Any, timeout_s: float = 600.0, threads: int = 1) -> list[Any] | None:
    """``fn(rank, world_size, *args)`` on every rank: on the launcher's ranks when launched (``ranks`` is then the
    launcher's; rank 0 returns the per-rank results, the others None), else on ``ranks`` spawned gloo CPU ranks
    (the results returned here). ``fn`` finds its device with ``rank_device()``."""
    if not launched():
        return spawn_ranks(fn, ranks, *args, timeout_s=timeout_s, threads=threads)
    import torch.distributed as dist

    init_launched(timeout_s=timeout_s)
    mine = fn(dist.get_rank(), dist.get_world_size(), *args)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every if dist.get_rank() == 0 else None


def rank_device() -> Any:
    """This rank's device: its GPU in an NCCL group, else the CPU."""
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def init_one_rank(device_type: str) -> None:
    """A one-rank process group in this process (an in-memory store: no port, no launcher), with the environment a
    launcher would set (RANK, WORLD_SIZE, MASTER_ADDR, ...), which DeepSpeed reads when it joins the group."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
