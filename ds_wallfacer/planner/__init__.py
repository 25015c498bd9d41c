"""Communication topology planner (docs/design/planner.md; bytes: attention.md, memory: memory.md).

Given a cluster, a model and a sequence length, predict every configuration's communication, compute and
peak memory per rank, and pick the fastest one that fits:

- ``ClusterSpec`` / ``CLUSTERS`` / ``from_env``: links, memory and compute per rank (presets, launch env)
- ``ModelSpec`` / ``MODELS``: shapes from an HF config or presets
- ``Candidate``, ``Workload``: one configuration, and what is trained
- ``calibrated``: a cluster with this device's measured compute (``calibrate.py``: a cached micro-benchmark)
- ``estimate`` (cost model, byte counts from ``attention.volume``), ``memory_breakdown`` (memory model)
- ``plan`` (all rows, ranked) and ``resolve`` (the choice for "auto" config values at start-up)
- ``resolve_auto`` / ``ParallelSetup``: a ``"wallfacer"`` section's "auto" values chosen (planner, else the safe rule)
- ``layouts`` / ``ulysses_groups``: the chosen placement as ``RankLayout``s and all-to-all groups
"""
from .._lazy import lazy_exports

_EXPORTS = {
    "ParallelSetup": ".auto",
    "PlanInputs": ".auto",
    "resolve_auto": ".auto",
    "STRATEGIES": ".candidate",
    "Strategy": ".candidate",
    "PLACEMENTS": ".candidate",
    "Candidate": ".candidate",
    "Workload": ".candidate",
    "CLUSTERS": ".cluster",
    "ClusterSpec": ".cluster",
    "from_env": ".cluster",
    "get_cluster": ".cluster",
    "Calibration": ".calibrate",
    "calibrated": ".calibrate",
    "CostBreakdown": ".cost",
    "estimate": ".cost",
    "layer_bytes": ".cost",
    "paper_figures": ".cost",
    "MemoryBreakdown": ".memory",
    "memory_breakdown": ".memory",
    "MODELS": ".model",
    "ModelSpec": ".model",
    "get_model": ".model",
    "analyse_links": ".placement",
    "layouts": ".placement",
    "sp_groups": ".placement",
    "ulysses_groups": ".placement",
    "FIXED_KEYS": ".search",
    "Plan": ".search",
    "PlanChoice": ".search",
    "PlanError": ".search",
    "Row": ".search",
    "enumerate_candidates": ".search",
    "max_seq_len": ".search",
    "plan": ".search",
    "resolve": ".search",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
