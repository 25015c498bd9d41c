"""Run a test body on N local gloo ranks and surface every rank's failure in the parent.

The spawner is the benchmarks' (``benchmarks/harness.py``), one for both: ``run_distributed(fn, world_size,
*args, timeout_s=..., start_method=...)`` runs ``fn(rank, world_size, *args)`` on fresh processes (``spawn``,
OMP_NUM_THREADS=1) and raises an AssertionError with the first failed rank's traceback. Many cases should be
grouped inside one launch: the process start-up and the imports dominate on a 2-core machine.
"""
from __future__ import annotations

from benchmarks.harness import free_port
from benchmarks.harness import spawn_ranks as run_distributed

__all__ = ["free_port", "run_distributed"]
