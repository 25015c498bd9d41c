"""Run a script as the ``deepspeed`` launcher would (``exit_probe.py [--local_rank=N] SCRIPT ARGS...``) and, last of
all the atexit handlers (just before the interpreter finalises), print one line
``exit_probe: rank R: initialized I, T threads of ours, N c10d threads [names]``: whether a process group is still
registered, this package's threads still alive, and the C++ threads of torch.distributed (their groups, though
destroyed, are freed only with the last object that holds them). Note [A clean exit] (docs/trainer.md)."""
from __future__ import annotations

import atexit
import os
import runpy
import sys
from pathlib import Path

C10D_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv", "pt_nccl_watchdg", "pt_nccl_heartbt")
"""Linux thread names (``/proc/self/task/*/comm``, 15 characters at most) of the threads c10d starts."""


def c10d_threads() -> list[str]:
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name in C10D_THREADS:
            names.append(name)
    return sorted(names)


def _report() -> None:
    import threading

    import torch.distributed as dist

    ours = [t.name for t in threading.enumerate() if t.name.startswith("ds_wallfacer-")]
    names = c10d_threads()
    print(f"exit_probe: rank {os.environ.get('RANK', '?')}: initialized {dist.is_initialized()}, {len(ours)} threads "
          f"of ours, {len(names)} c10d threads {names}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    atexit.register(_report)  # first registered, so it runs after every handler the script registers
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    script = args[0]
    sys.argv = args
    runpy.run_path(script, run_name="__main__")
