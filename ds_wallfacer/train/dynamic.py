"""The trainer's data under dynamic sequence parallelism (``wallfacer.dynamic_sequence_parallel``): every document
of the training split is a row of its own length (a document longer than ``--seq_len`` is cut into rows of
``--seq_len``), and each optimizer step is one ``DynamicStep`` of ``sp.dataloader`` (Note [Dynamic sequence
parallelism] in docs/design/training.md).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np
import torch

from .cli import StartupError
from .data import document_lengths

__all__ = ["DynamicData", "document_rows"]


def document_rows(seqs: np.ndarray, *, eos_id: int, seq_len: int) -> list[np.ndarray]:
    """The split's token stream (its rows joined) cut after every EOS into documents, each one row, those longer than
    ``seq_len`` cut into rows of ``seq_len`` (the last one shorter); rows of one token (no label) are left out."""
    stream = np.asarray(seqs).reshape(-1)
    rows, at = [], 0
    for n in document_lengths(stream, eos_id) if stream.size else []:
        for a in range(at, at + n, seq_len):
            piece = stream[a:min(a + seq_len, at + n)]
            if len(piece) > 1:
                rows.append(piece)
        at += n
    return rows


class DynamicData:
    """The training rows and, epoch by epoch, their optimizer steps (``DynamicStepLoader``: the same rows in the same
    steps on every rank and on resume)."""

    def __init__(self, sp: Any, seqs: np.ndarray, *, eos_id: int | None, seq_len: int, seed: int,
                 rows_per_step: int) -> None:
        if eos_id is None:
            raise StartupError("wallfacer.dynamic_sequence_parallel trains each document as a row, which needs the "
                               "tokenizer's EOS token to find them: use a tokenizer with an eos_token")
        self.rows = [{"input_ids": torch.from_numpy(r.astype(np.int64))}
                     for r in document_rows(seqs, eos_id=eos_id, seq_len=seq_len)]
        self.rows_per_step = rows_per_step
        if len(self.rows) < rows_per_step:
            raise StartupError(
                f"the training split has {len(self.rows)} documents, fewer than one step's {rows_per_step} rows "
                "(micro batch x gradient accumulation x data-parallel size): add data or lower the batch sizes")
        self.loader = sp.dataloader(self.rows, shuffle=True, seed=seed)
        self._steps: Iterator[Any] = iter(())

    @property
    def steps_per_epoch(self) -> int:
        return len(self.loader)

    def steps(self, epoch: int, sequences_in_epoch: int) -> Iterator[Any]:
        """Epoch ``epoch``'s steps after its first ``sequences_in_epoch`` rows (a multiple of a step's rows)."""
        self.loader.set_epoch(epoch, start_step=sequences_in_epoch // self.rows_per_step)
        return iter(self.loader)

    def start(self, state: dict[str, int]) -> None:
        """Continue from the trainer's data position (``state``: ``epoch``, ``sequences_in_epoch``)."""
        self._steps = self.steps(state["epoch"], state["sequences_in_epoch"])

    def train_step(self, engine: Any, *, state: dict[str, int], acc: torch.Tensor, gate: Any,
                   to_device: Callable[[dict], dict]) -> int:
        """One optimizer step: this rank's forward and backward of each round of the next step (the next epoch's
        first when this one is done), then one ``engine.step()``; the losses added to ``acc[0]``, ``state``
        advanced. Returns the step's tokens."""
        step = next(self._steps, None)
        if step is None:  # epoch done: reshuffle
            state["epoch"] += 1
            state["sequences_in_epoch"] = 0
            self._steps = self.steps(state["epoch"], 0)
            step = next(self._steps)
        for batch in step:
            loss = engine(**to_device(batch))
            engine.backward(loss)
            acc[0] += loss.detach().float()
        if gate is not None:
            gate.loss_finite = bool(torch.isfinite(acc[0]))
        engine.step()
        state["sequences_in_epoch"] += self.rows_per_step
        return sum(step.lengths)
