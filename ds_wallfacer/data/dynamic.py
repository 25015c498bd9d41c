"""The dynamic sequence-parallel loader: a map-style dataset of rows of any length -> per optimizer step, this
rank's batches of the step's rounds, each row sharded over the group of the size it was given.

A step is the same rows a fixed-P run trains in one optimizer step (``rows_per_step``, taken in the epoch's seeded
order); ``choose(lengths, works)`` gives each row its group size, ``steps.dynamic_rounds`` lays the rows out in
rounds that tile the world's ranks, and each rank takes its slot of every round. Every batch carries
``sequence_parallel_size`` (its group's size) and ``loss_weight`` (W x GA / (p x T), T the step's labelled tokens):
the loss module turns the group's summed token losses into the step's token mean with it. Everything is a function
of the dataset, the seed and the step, so every rank computes the same rounds, and a resumed run replays them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from .loader import ShardSpec, collate_right_padded, item_work, prepare_batch
from .steps import FILLER, Slot, dynamic_rounds, rank_slots, round_seconds

__all__ = ["DynamicStep", "DynamicStepLoader", "labelled_tokens"]

Choose = Callable[[Sequence[int], Sequence[int]], list[int]]
"""(row lengths, row attention works) -> each row's group size."""
Seconds = Callable[[int, int, int], float]
"""(length, work, group size) -> predicted seconds of the row's forward + backward."""


def labelled_tokens(batch: Mapping[str, Any], *, ignore_index: int = -100) -> int:
    """Tokens of a full (unsharded) batch that carry a label after shifting (documents' last tokens excluded)."""
    full = prepare_batch(batch, ShardSpec(index=0, sp_size=1), ignore_index=ignore_index)
    return int((full["shift_labels"] != ignore_index).sum())


@dataclass
class DynamicStep:
    """One optimizer step: this rank's batch of each round, and what the schedule decided for the whole step."""

    batches: list[dict[str, torch.Tensor]]
    """This rank's batch of each round, in order (iterate the step to get them)."""
    sizes: list[int]
    """Each row's group size."""
    rounds: list[list[Slot]]
    """Every round's slots (all ranks)."""
    lengths: list[int]
    """Each row's tokens."""
    labelled: int
    """T: labelled tokens of the step (the token mean's denominator)."""
    predicted_s: list[float] = field(default_factory=list)
    """Each round's predicted length (its slowest group)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)

    @property
    def fillers(self) -> int:
        """Slots of the step's rounds no row took (rank-rounds run on a filler)."""
        return sum(s.row == FILLER for slots in self.rounds for s in slots)


class DynamicStepLoader:
    """Map-style dataset -> ``DynamicStep`` per optimizer step (``len(source) // rows_per_step`` per epoch)::

        for step in loader:
            for batch in step:
                engine.backward(engine(**batch))
            engine.step()

    ``specs``: this rank's shard spec in its group of each size; ``verify(size, batch)``: checks the group of
    ``size`` holds the same full batch (or None)."""

    def __init__(self, source: Any, *, specs: Mapping[int, ShardSpec], rank: int, world_size: int, sp_size: int,
                 rows_per_step: int, gradient_accumulation_steps: int, choose: Choose, seconds: Seconds,
                 shuffle: bool = True, seed: int = 0, pad_token_id: int = 0, ignore_index: int = -100,
                 verify: Callable[[int, Mapping[str, Any]], None] | None = None) -> None:
        if not (hasattr(source, "__getitem__") and hasattr(source, "__len__")):
            raise ValueError("dynamic sequence parallelism needs a map-style dataset (__getitem__ and __len__): it "
                             "reads each step's rows to choose their group sizes")
        if rows_per_step < 1 or len(source) < rows_per_step:
            raise ValueError(f"the dataset has {len(source)} rows, fewer than one step's {rows_per_step} "
                             "(train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size)")
        self.source, self.specs, self.rank, self.world_size, self.sp_size = source, dict(specs), rank, world_size, sp_size
        self.rows_per_step, self.gas = rows_per_step, gradient_accumulation_steps
        self.choose, self.seconds, self.shuffle, self.seed = choose, seconds, shuffle, seed
        self.pad_token_id, self.ignore_index, self.verify = pad_token_id, ignore_index, verify
        self.epoch, self.start_step = 0, 0

    def __len__(self) -> int:
        """Optimizer steps per epoch."""
        return len(self.source) // self.rows_per_step

    def set_epoch(self, epoch: int, *, start_step: int = 0) -> None:
        """The epoch to iterate (its seeded order), from its step ``start_step`` (a resumed run)."""
        self.epoch, self.start_step = epoch, start_step

    def order(self, epoch: int) -> list[int]:
        """The epoch's row order (the same on every rank)."""
        if not self.shuffle:
            return list(range(len(self.source)))
        g = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's seeding
        return torch.randperm(len(self.source), generator=g).tolist()

    def __iter__(self) -> Iterator[DynamicStep]:
        order, per = self.order(self.epoch), self.rows_per_step
        for k in range(self.start_step, len(self)):
            yield self.step([self.source[i] for i in order[k * per:(k + 1) * per]])

    def step(self, items: Sequence[Any]) -> DynamicStep:
        """The rounds of one step's rows (``items``: map-style items, ``collate_right_padded``'s forms)."""
        rows = [collate_right_padded([it], pad_token_id=self.pad_token_id, ignore_index=self.ignore_index)
                for it in items]
        lengths = [int(r["input_ids"].shape[1]) for r in rows]
        works = [item_work(it) for it in items]
        labelled = sum(labelled_tokens(r, ignore_index=self.ignore_index) for r in rows)
        sizes = self.choose(lengths, works)
        secs = [self.seconds(n, w, p) for n, w, p in zip(lengths, works, sizes)]
        rounds = dynamic_rounds(sizes, secs, world_size=self.world_size, sp_size=self.sp_size,
                                sizes=sorted(self.specs))
        batches = [self._shard(slot, rows) for slot in rank_slots(rounds, self.rank)]
        for b in batches:
            b["loss_weight"] = torch.tensor(
                [self.world_size * self.gas / (int(b["sequence_parallel_size"]) * labelled) if labelled else 0.0],
                dtype=torch.float64)
        return DynamicStep(batches=batches, sizes=sizes, rounds=rounds, lengths=lengths, labelled=labelled,
                           predicted_s=round_seconds(rounds, secs))

    def _shard(self, slot: Slot, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        if slot.row == FILLER:  # the shortest row there is, every label ignored: its gradient is exactly zero
            full: Mapping[str, Any] = {"input_ids": torch.full((1, 2), self.pad_token_id, dtype=torch.long),
                                       "shift_labels": torch.full((1, 2), self.ignore_index, dtype=torch.long)}
        else:
            full = rows[slot.row]
        if self.verify is not None and slot.size > 1:
            self.verify(slot.size, full)
        out = prepare_batch(full, self.specs[slot.size], pad_token_id=self.pad_token_id,
                            ignore_index=self.ignore_index)
        out["sequence_parallel_size"] = torch.tensor([slot.size], dtype=torch.int64)
        return out
