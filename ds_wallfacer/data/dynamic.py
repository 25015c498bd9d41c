"""The dynamic sequence-parallel loader: a map-style dataset of rows of any length -> per optimizer step, this
rank's batches of the step's rounds, each row sharded over the group of the size it was given.

A step holds exactly the rows the fixed-P run (``SequenceParallelLoader`` over the same dataset, seed and batch
sizes) trains in that optimizer step: the epoch's order split over the D = W / P replicas as
``DistributedSampler`` splits it, ``micro`` rows per micro-batch, ``gradient_accumulation_steps`` micro-batches per
step. ``choose(lengths, works)`` (a ``planner.dynamic.SizeChooser``) gives each row its group size,
``steps.dynamic_rounds`` lays the rows out in rounds that tile the world's ranks, and each rank takes its slot of
every round. Every batch carries
``sequence_parallel_size`` (p, its group's size) and ``loss_weight`` = W / (p x D x c), c the labelled tokens of the
fixed run's micro-batch that holds the row: the loss module multiplies the group's summed token losses by it, and
the step's gradient is the fixed run's (Note [Dynamic sequence parallelism]). Everything is a function of the
dataset, the seed and the step, so every rank computes the same rounds, and a resumed run replays them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from ..planner.dynamic import SizeChooser
from .loader import ShardSpec, collate_right_padded, item_work, prepare_batch
from .steps import FILLER, Slot, dynamic_rounds, rank_slots

__all__ = ["DynamicStep", "DynamicStepLoader", "labelled_tokens"]

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

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class DynamicStepLoader:
    """Map-style dataset -> ``DynamicStep`` per optimizer step (``len(source) // rows_per_step`` per epoch)::

        for step in loader:
            for batch in step:
                engine.backward(engine(**batch))
            engine.step()

    ``specs``: this rank's shard spec in its group of each size; ``verify(size, batch)``: checks the group of
    ``size`` holds the same full batch (or None); ``check_row(name, length)``: raises for a row no group fits, called
    for every row when the loader is built (None: the choice raises when the row's step comes)."""

    def __init__(self, source: Any, *, specs: Mapping[int, ShardSpec], rank: int, world_size: int, sp_size: int,
                 micro_batch: int, gradient_accumulation_steps: int, choose: SizeChooser, seconds: Seconds,
                 shuffle: bool = True, seed: int = 0, pad_token_id: int = 0, ignore_index: int = -100,
                 verify: Callable[[int, Mapping[str, Any]], None] | None = None,
                 check_row: Callable[[str, int], None] | None = None) -> None:
        if not (hasattr(source, "__getitem__") and hasattr(source, "__len__")):
            raise ValueError("dynamic sequence parallelism needs a map-style dataset (__getitem__ and __len__): it "
                             "reads each step's rows to choose their group sizes")
        self.source, self.specs, self.rank, self.world_size, self.sp_size = source, dict(specs), rank, world_size, sp_size
        self.micro, self.gas, self.dp = micro_batch, gradient_accumulation_steps, world_size // sp_size
        self.rows_per_step = micro_batch * gradient_accumulation_steps * self.dp
        if len(source) < self.rows_per_step:
            raise ValueError(f"the dataset has {len(source)} rows, fewer than one step's {self.rows_per_step} "
                             "(train_micro_batch_size_per_gpu x gradient_accumulation_steps x data-parallel size)")
        self.choose, self.seconds, self.shuffle, self.seed = choose, seconds, shuffle, seed
        self.pad_token_id, self.ignore_index, self.verify = pad_token_id, ignore_index, verify
        self.epoch, self.start_step = 0, 0
        if check_row is not None:  # every row read once now: one too long for P ranks is refused before any training
            for i in range(len(source)):
                check_row(f"row {i} of the dataset",
                          len(collate_right_padded([source[i]], pad_token_id=pad_token_id)["input_ids"][0]))

    def __len__(self) -> int:
        """Optimizer steps per epoch."""
        return len(self.source) // self.rows_per_step

    def set_epoch(self, epoch: int, *, start_step: int = 0) -> None:
        """The epoch to iterate (its seeded order), from its step ``start_step`` (a resumed run)."""
        self.epoch, self.start_step = epoch, start_step

    def replica_orders(self, epoch: int) -> list[list[int]]:
        """Each replica's rows of the epoch, as ``DistributedSampler(drop_last=True)`` deals them (the same on every
        rank)."""
        n = len(self.source) // self.dp * self.dp
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)  # DistributedSampler's seeding
            order = torch.randperm(len(self.source), generator=g).tolist()[:n]
        else:
            order = list(range(n))
        return [order[d::self.dp] for d in range(self.dp)]

    def __iter__(self) -> Iterator[DynamicStep]:
        replicas, per = self.replica_orders(self.epoch), self.micro * self.gas
        for k in range(self.start_step, len(self)):
            rows = [i for r in replicas for i in r[k * per:(k + 1) * per]]  # replica by replica
            yield self.step([self.source[i] for i in rows])

    def step(self, items: Sequence[Any]) -> DynamicStep:
        """The rounds of one step's rows (``items``: map-style items, ``collate_right_padded``'s forms, replica by
        replica as ``__iter__`` lists them: consecutive ``micro`` rows form one of the fixed run's micro-batches)."""
        rows = [collate_right_padded([it], pad_token_id=self.pad_token_id, ignore_index=self.ignore_index)
                for it in items]
        lengths = [int(r["input_ids"].shape[1]) for r in rows]
        works = [item_work(it) for it in items]
        counts = [labelled_tokens(r, ignore_index=self.ignore_index) for r in rows]
        per_micro = [sum(counts[a:a + self.micro]) for a in range(0, len(counts), self.micro)]
        micro_count = [per_micro[i // self.micro] for i in range(len(rows))]
        sizes = self.choose(lengths, works)
        secs = [self.seconds(n, w, p) for n, w, p in zip(lengths, works, sizes)]
        rounds = dynamic_rounds(sizes, secs, world_size=self.world_size, sp_size=self.sp_size,
                                sizes=sorted(self.specs))
        batches = []
        for slot in rank_slots(rounds, self.rank):
            b = self._shard(slot, rows)
            c = micro_count[slot.row] if slot.row != FILLER else 0
            b["loss_weight"] = torch.tensor([self.world_size / (slot.size * self.dp * c) if c else 0.0],
                                            dtype=torch.float64)
            batches.append(b)
        return DynamicStep(batches=batches, sizes=sizes, rounds=rounds, lengths=lengths)

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
