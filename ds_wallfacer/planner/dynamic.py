"""Dynamic sequence parallelism's choice: how many ranks each row of a step gets (``choose_sizes``), from the
planner's cost and memory models (``RowModel``). Deterministic: no measured speeds, so every rank chooses alike.

The rule (Note [Dynamic sequence parallelism] in docs/design/training.md): each row's smallest group size whose
memory fits it (or whose local tokens stay within ``max_tokens_per_rank``); then a time limit t is chosen, each row
growing to the smallest size that runs it within t (or the largest), and the rows laid out in rounds
(``data.steps.dynamic_rounds``); the t whose rounds end soonest wins (ties: the one with fewer rank-seconds, i.e.
less communication). A round lasts as long as its slowest group, because ZeRO's collectives keep every rank in
step: rows of similar times in one round waste least, and one long row on few ranks would keep every other rank
waiting.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Protocol, Sequence

from ..comm.dims import ParallelDims, sub_dims
from ..config.schema import RunConfig
from .auto import run_facts
from .candidate import Candidate, Workload
from .cluster import ClusterSpec, cluster_preset, get_cluster
from .cost import estimate
from .memory import memory_breakdown
from .model import ModelSpec, get_model

__all__ = ["RowModel", "RowSizeChooser", "SizeChooser", "choose_sizes", "row_candidates", "row_model"]


class SizeChooser(Protocol):
    """Dynamic sequence parallelism's choice as the loader calls it once per step (``data/dynamic.py``): each row's
    group size from the rows' lengths and attention works. ``RowSizeChooser`` is the run's; tests pass functions."""

    def __call__(self, lengths: Sequence[int], works: Sequence[int]) -> list[int]: ...


def row_candidates(shapes: Mapping[int, ParallelDims], *, mini_sequence: bool, checkpointing: bool,
                   keep_attention: bool = True, reentrant: bool = True) -> dict[int, Candidate]:
    """The planner's ``Candidate`` of each group size's layout (``comm.dims.sub_dims``)."""
    return {
        p: Candidate(sp_size=p, ring_count=d.ring_count, ulysses_degree=d.ulysses_degree, placement=d.placement,
                     mini_sequence=mini_sequence, checkpointing=checkpointing, keep_attention=keep_attention,
                     reentrant=reentrant)
        for p, d in shapes.items()
    }


def _bucket(n: int, p: int) -> int:
    """n padded to a multiple of 2p, then up to the next of 16 steps per octave: the estimates are smooth in n, and
    a step's lengths then share a few cached estimates."""
    n = max(n, 2 * p)
    step = max(2 * p, 2 ** max(0, math.floor(math.log2(n)) - 4))
    return -(-n // step) * step


@dataclass(frozen=True)
class RowModel:
    """Seconds and memory fit of one row on a group of p ranks, from ``planner.cost.estimate`` and
    ``planner.memory.memory_breakdown`` (uncalibrated: identical on every host)."""

    model: ModelSpec
    cluster: ClusterSpec
    """The whole world's hardware (ZeRO partitions over every rank, whatever the group size)."""
    workload: Workload
    """The run's facts (ZeRO stage, dtype, offloads); its ``seq_len`` is replaced by each row's."""
    candidates: Mapping[int, Candidate]
    """Group size -> its layout (``row_candidates``)."""
    max_tokens_per_rank: int | None = None
    """When set, "fits" is "at most this many local tokens" instead of the memory model."""
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.candidates))

    def _cost(self, n: int, p: int):
        key = ("cost", _bucket(n, p), p)
        if key not in self._cache:
            w = replace(self.workload, seq_len=key[1], batch=1)
            self._cache[key] = estimate(self.model, self.cluster, self.candidates[p], w)
        return self._cache[key]

    def fits(self, n: int, p: int) -> bool:
        """Whether a row of ``n`` tokens fits a group of ``p`` ranks."""
        if self.max_tokens_per_rank is not None:
            return -(-n // p) <= self.max_tokens_per_rank
        key = ("mem", _bucket(n, p), p)
        if key not in self._cache:
            w = replace(self.workload, seq_len=key[1], batch=1)
            self._cache[key] = memory_breakdown(self.model, self.cluster, self.candidates[p], w).fits
        return self._cache[key]

    def check_row(self, name: str, n: int) -> None:
        """Raise ``ValueError`` when even the largest group does not fit a row of ``n`` tokens (``name``: which)."""
        if not self.fits(n, self.sizes[-1]):
            cap = (f"max_tokens_per_rank = {self.max_tokens_per_rank}" if self.max_tokens_per_rank is not None
                   else f"the memory model of {self.cluster.name}")
            raise ValueError(
                f"{name} has {n} tokens, more than a group of {self.sizes[-1]} ranks holds ({cap}): raise "
                f"sequence_parallel_size or wallfacer.dynamic_sequence_parallel.max_tokens_per_rank, or cut the row")

    def seconds(self, n: int, work: int, p: int) -> float:
        """Predicted forward + backward seconds of a row of ``n`` tokens whose attention does ``work`` score entries
        (a causal row: n(n+1)/2; packed documents: the sum of theirs), on ``p`` ranks: the planner's step without its
        optimizer and ZeRO terms, its attention part scaled by ``work`` over a causal row's."""
        c = self._cost(n, p)
        m = _bucket(n, p)
        attention = self.model.layers * c.attn_layer_s
        rest = max(0.0, c.step_s - attention - c.optimizer_s - c.detail.get("zero_exposed_s", 0.0))
        dense = m * (m + 1) / 2
        return rest * n / m + attention * (work / dense if dense else 0.0)


def choose_sizes(lengths: Sequence[int], works: Sequence[int], *, model: RowModel, world_size: int,
                 sp_size: int) -> list[int]:
    """Each row's group size (the rule in the module docstring). Raises ``ValueError`` for a row no size fits."""
    from ..data.steps import dynamic_rounds, round_seconds

    sizes = model.sizes
    fitting: list[list[int]] = []
    for i, n in enumerate(lengths):
        model.check_row(f"row {i}", n)
        fitting.append([p for p in sizes if model.fits(n, p)])
    secs = [{p: model.seconds(n, w, p) for p in ok} for n, w, ok in zip(lengths, works, fitting)]
    best: tuple[float, float] | None = None
    chosen: list[int] = []
    for limit in sorted({t for row in secs for t in row.values()}, reverse=True):
        trial = [next((p for p in ok if row[p] <= limit), ok[-1]) for ok, row in zip(fitting, secs)]
        t = [row[p] for row, p in zip(secs, trial)]
        rounds = dynamic_rounds(trial, t, world_size=world_size, sp_size=sp_size, sizes=sizes)
        key = (sum(round_seconds(rounds, t)), sum(p * x for p, x in zip(trial, t)))
        if best is None or key < best:
            best, chosen = key, trial
    return chosen


@dataclass(frozen=True)
class RowSizeChooser:
    """``choose_sizes`` over one run's ``RowModel`` and world: the run's ``SizeChooser``."""

    model: RowModel
    world_size: int
    """W."""
    sp_size: int
    """P, the largest group size."""

    def __call__(self, lengths: Sequence[int], works: Sequence[int]) -> list[int]:
        return choose_sizes(lengths, works, model=self.model, world_size=self.world_size, sp_size=self.sp_size)


def row_model(text: Any, run: RunConfig, *, sizes: Sequence[int], dims: ParallelDims,
              layer_checkpointing: bool) -> RowModel:
    """The planner's model of one row on each group size, for dynamic sequence parallelism's choice: the
    ``wallfacer.cluster`` preset's figures (uncalibrated, so every host chooses alike). ``text``: the model's (text)
    config; ``layer_checkpointing``: whether the model's layers are checkpointed already (the caller's
    ``gradient_checkpointing_enable``)."""
    cfg = run.wallfacer
    ms = cfg.mini_sequence
    cluster = get_cluster(cluster_preset() if cfg.cluster == "auto" else cfg.cluster).with_world_size(dims.world_size)
    facts = run_facts(run)
    facts["offload_checkpoints"] |= ms is not None and ms.offload_checkpoints
    checkpointing = layer_checkpointing or (ms is not None and ms.activation_checkpointing != "none")
    cands = row_candidates({p: sub_dims(dims, p) for p in sizes}, mini_sequence=ms is not None,
                           checkpointing=checkpointing, keep_attention=ms.keep_attention if ms is not None else True)
    cap = cfg.dynamic_sequence_parallel.max_tokens_per_rank
    return RowModel(model=get_model(text), cluster=cluster, workload=Workload(seq_len=2 * dims.sp_size, **facts),
                    candidates=cands, max_tokens_per_rank=None if cap == "auto" else int(cap))
