"""The Trainer's accelerator as TRL's losses must see it under sequence parallelism: one process per replica.

TRL's trainers gather per-sequence values across processes (rewards, log-probabilities, token counts) and, in
GRPO, normalise rewards over the gathered group and take back this process's slice. Under sequence parallelism
the P ranks of a group hold the same sequences, so a gather over all W ranks would repeat every sequence P times:
the means survive that, but token counts, standard deviations and slices do not. ``ReplicaAccelerator`` answers
as if each sequence-parallel group were one process: ``num_processes`` is D, ``process_index`` the replica, and a
gather keeps one rank per group (its first) in replica order. It runs the real accelerator's collectives (every rank
still takes part) and keeps only the rows of those ranks, so what TRL computes from it is what a D-process run
computes. Everything else is the real accelerator.

``ReplicaView`` puts it in place of ``trainer.accelerator`` for the span of a call (``with view(trainer):``), and of
the ``gather`` / ``gather_object`` functions the TRL module imported from accelerate by name (GRPO and RLOO gather
rewards, KL terms and the completions table that way), so the Trainer's own training loop (backward, the optimizer
step, checkpoints) keeps the real ones.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = ["ReplicaAccelerator", "ReplicaView"]


class ReplicaAccelerator:
    """``accelerate.Accelerator`` with every sequence-parallel group counted as one process."""

    def __init__(self, accelerator: Any, *, dims: Any, dp_index: int) -> None:
        self._accelerator = accelerator
        self._world = dims.world_size
        self._leaders = [dims.sp_ranks(d)[0] for d in range(dims.dp_size)]
        self.num_processes = dims.dp_size
        self.process_index = dp_index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    # -- selecting the replicas' rows ---------------------------------------------------------------------
    def select(self, gathered: Any) -> Any:
        """A value gathered over all W ranks (concatenated along dim 0, or stacked for 0-d tensors; nested in
        lists, tuples and dicts) -> the rows of the first rank of each replica."""
        if isinstance(gathered, torch.Tensor):
            if gathered.shape[0] % self._world:
                raise ValueError(f"a gathered tensor of {gathered.shape[0]} rows is not {self._world} equal parts")
            parts = gathered.reshape(self._world, gathered.shape[0] // self._world, *gathered.shape[1:])
            index = torch.tensor(self._leaders, device=gathered.device)
            return parts.index_select(0, index).reshape(-1, *gathered.shape[1:])
        if isinstance(gathered, (list, tuple)):
            return type(gathered)(self.select(g) for g in gathered)
        if isinstance(gathered, dict):
            return {k: self.select(v) for k, v in gathered.items()}
        return gathered

    def gather(self, tensor: Any) -> Any:
        return self.select(self._accelerator.gather(tensor))

    def gather_for_metrics(self, input_data: Any, use_gather_object: bool = False) -> Any:
        if use_gather_object or not _all_tensors(input_data):
            return self.gather_object(input_data)
        return self.gather(input_data)  # evaluation sets divide evenly (the mixin refuses the others)

    def gather_object(self, obj: Any) -> list:
        from accelerate.utils import gather_object

        return self.select_objects(gather_object(obj if isinstance(obj, list) else [obj]))

    def select_objects(self, every: list) -> list:
        """Items gathered from all W ranks (W equal parts, in rank order) -> the parts of each replica's first
        rank."""
        if len(every) % self._world:
            raise ValueError(f"gather_object: {len(every)} items from {self._world} ranks are not equal parts")
        per = len(every) // self._world
        return [x for r in self._leaders for x in every[r * per:(r + 1) * per]]

    def prepare(self, *objects: Any, **kwargs: Any) -> Any:
        """A DataLoader is sharded over the replicas (the ranks of a group draw the same batches); anything else
        is the real accelerator's."""
        from torch.utils.data import DataLoader

        from .data import replica_prepare

        if len(objects) == 1 and isinstance(objects[0], DataLoader) and not kwargs:
            return replica_prepare(objects[0], dp_size=self.num_processes, dp_rank=self.process_index,
                                   accelerator=self._accelerator)
        return self._accelerator.prepare(*objects, **kwargs)

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        rows = self.gather(tensor[None])
        if reduction == "sum":
            out = rows.sum(0)
        elif reduction == "mean":
            out = rows.mean(0)
        else:
            raise ValueError(f"reduce: reduction {reduction!r} is not supported under sequence parallelism")
        return (out * scale).reshape(tensor.shape)


def _all_tensors(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return all(_all_tensors(v) for v in x)
    if isinstance(x, dict):
        return all(_all_tensors(v) for v in x.values())
    return False


_MODULE_GATHERS = ("gather", "gather_object")
"""accelerate's functions some TRL trainer modules call by name (``from accelerate.utils import gather, ...``)."""


class ReplicaView:
    """``with view(trainer):`` -> ``trainer.accelerator`` is the ``ReplicaAccelerator``, and so are the gathers the
    trainer's TRL module calls by name (``module``: ``gather``, ``gather_object``); re-entrant."""

    def __init__(self, accelerator: Any, *, dims: Any, dp_index: int, module: Any = None) -> None:
        self.replicas = ReplicaAccelerator(accelerator, dims=dims, dp_index=dp_index)
        self._module = module
        self._depth = 0

    @contextlib.contextmanager
    def __call__(self, trainer: Any) -> Iterator[ReplicaAccelerator]:
        outermost = self._depth == 0
        saved = {}
        if outermost:
            trainer.__dict__["accelerator"] = self.replicas
            for name in _MODULE_GATHERS:
                if self._module is not None and hasattr(self._module, name):
                    saved[name] = getattr(self._module, name)
                    setattr(self._module, name, getattr(self.replicas, name))
        self._depth += 1
        try:
            yield self.replicas
        finally:
            self._depth -= 1
            if outermost:
                trainer.__dict__["accelerator"] = self.replicas._accelerator
                for name, fn in saved.items():
                    setattr(self._module, name, fn)
