"""Communication topology planner (issue 5; DESIGN.md sections 2 and 4).

Given a cluster, a model and a sequence length, predict every configuration's communication, compute and
peak memory per rank, and pick the fastest one that fits:

- ``ClusterSpec`` / ``CLUSTERS`` / ``from_env``: links, memory and compute per rank (presets, launch env)
- ``ModelSpec`` / ``MODELS``: shapes from an HF config or presets
- ``Candidate``, ``Workload``: one configuration, and what is trained
- ``estimate`` (cost model, byte counts from ``attention.volume``), ``memory_breakdown`` (memory model)
- ``plan`` (all rows, ranked) and ``resolve`` (the choice for "auto" config values at start-up)
- ``layouts`` / ``ulysses_groups``: the chosen placement as ``RankLayout``s and all-to-all groups
"""
from .candidate import MODES, PLACEMENTS, Candidate, Workload
from .cluster import CLUSTERS, ClusterSpec, from_env, get_cluster
from .cost import CostBreakdown, estimate, layer_bytes, paper_figures
from .memory import MemoryBreakdown, memory_breakdown
from .model import MODELS, ModelSpec, get_model
from .placement import analyse_links, layouts, sp_groups, ulysses_groups
from .search import FIXED_KEYS, Plan, PlanChoice, PlanError, Row, enumerate_candidates, plan, resolve

__all__ = [
    "CLUSTERS", "Candidate", "ClusterSpec", "CostBreakdown", "FIXED_KEYS", "MODELS", "MODES", "MemoryBreakdown",
    "ModelSpec", "PLACEMENTS", "Plan", "PlanChoice", "PlanError", "Row", "Workload", "analyse_links",
    "enumerate_candidates", "estimate", "from_env", "get_cluster", "get_model", "layer_bytes", "layouts",
    "memory_breakdown", "paper_figures", "plan", "resolve", "sp_groups", "ulysses_groups",
]
