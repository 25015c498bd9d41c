"""The order the trainer takes its training sequences in, epoch by epoch: the seeded shuffle, or work-balanced
rounds (``--balance_steps``); each round's attention-work imbalance, and whether a checkpoint can continue its
epoch in this order.

Design: Note [Token cache and data order] and Note [Work-balanced steps] in docs/design/documents.md.
"""
from __future__ import annotations

import numpy as np

from ..data.steps import round_balance
from .data import _Batches, row_works, train_batches

__all__ = ["DataOrder", "resume_order_error"]


def resume_order_error(saved_round: int, round_now: int, sequences_in_epoch: int) -> str | None:
    """Why a checkpoint cannot continue its epoch in this run's data order, or None. ``*_round``: rows per
    work-balanced round (``--balance_steps``: micro batch x data-parallel size), 0 for the plain shuffle. Rounds of
    another size hold other rows, so mid-epoch the rest of the epoch would repeat some rows and skip others; at an
    epoch boundary any order may start."""
    if saved_round == round_now or sequences_in_epoch == 0:
        return None
    saved, now = (f"work-balanced rounds of {r} rows" if r else "the plain shuffle" for r in (saved_round, round_now))
    return (f"saved after {sequences_in_epoch} sequences of its epoch in {saved}, but this run orders the epoch in "
            f"{now}: the rest of the epoch would repeat some sequences and skip others. Resume with the saved run's "
            "--balance_steps setting and micro batch x data-parallel size")


class DataOrder:
    """The training split's order for ``micro`` sequences per micro-batch and ``dp`` replicas. ``eos_id`` (document
    masking): every row's attention work is weighed once, so each round's imbalance is known on every rank;
    ``balance``: the epochs are put in work-balanced rounds of ``micro * dp`` rows."""

    def __init__(self, seqs: np.ndarray, *, micro: int, dp: int, seed: int, eos_id: int | None,
                 balance: bool) -> None:
        self.seqs, self.micro, self.dp, self.seed, self.eos_id = seqs, micro, dp, seed, eos_id
        self.work = row_works(seqs, eos_id) if eos_id is not None else None
        self.round_rows = micro * dp if balance else 0
        """Rows per work-balanced round; 0 for the plain shuffle (saved in checkpoints as ``balanced_round``)."""
        self._order: np.ndarray | None = None

    def epoch(self, epoch: int, start: int) -> _Batches:
        """Epoch ``epoch``'s global micro-batches from sequence ``start`` on (``data.train_batches``)."""
        src = train_batches(self.seqs, micro=self.micro, dp=self.dp, epoch=epoch, seed=self.seed, start=start,
                            eos_id=self.eos_id, work=self.work if self.round_rows else None)
        self._order = src.order
        return src

    def imbalance(self, at: int) -> float | None:
        """The round starting at sequence ``at`` of the current epoch: busiest replica's attention work over the mean
        replica's; None without document masking."""
        if self.work is None or self._order is None:
            return None
        rows = self._order[at : at + self.micro * self.dp].tolist()
        return round_balance(self.work, rows, per_replica=self.micro, replicas=self.dp)[0]

    def resume_error(self, saved_round: int, sequences_in_epoch: int) -> str | None:
        """``resume_order_error`` against this order."""
        return resume_order_error(saved_round, self.round_rows, sequences_in_epoch)
