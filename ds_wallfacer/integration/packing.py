"""Packed batches at the model's forward: the loader's ``document_ids`` / ``chunk_assignment`` turned into what
attention needs (``attention.documents.SequenceBatch``), checked across the sequence-parallel group.

The ``SequenceBatch`` reaches every attention layer as the keyword ``wallfacer_batch`` of the model's forward:
HF models hand unknown forward keywords down to the attention function (``hf.py``), through their own and our
layer checkpointing, so no state is kept between steps.

Every rank of a sequence-parallel group must agree on the documents and on which chunks each rank holds, and
its position ids must be the positions inside those documents; a batch built outside the loader can break any
of these. One small all-gather per step (kind ``check``) compares a signature of both and each rank's local
position check, so every rank raises the same error at the first step instead of some waiting forever in the
ring.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention.documents import BatchDocuments, SequenceBatch
from ..comm import CommLayer
from ..data.loader import ShardSpec
from ..data.packing import document_positions
from ..data.pieces import shard_sequence
from .hf import BATCH_KWARG

__all__ = ["BATCH_KWARG", "PackedBatches", "document_starts"]



def document_starts(document_ids: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """[B, N] document index per token -> per row, the start index of every document."""
    ids = document_ids.reshape(document_ids.shape[0], -1)
    change = ids[:, 1:] != ids[:, :-1]  # [B, N-1]
    return tuple((0, *(int(i) + 1 for i in torch.nonzero(row).flatten().tolist())) for row in change)


def _signature(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1).long()
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) % 1_000_003
    return torch.stack([x.new_tensor(x.numel()), (x * w).sum(), x.sum()])


@dataclass
class PackedBatches:
    """Builds and checks the ``SequenceBatch`` of each packed forward on this rank."""

    group: dist.ProcessGroup
    """The sequence-parallel group (whose ranks must agree)."""
    comm: CommLayer
    spec: ShardSpec
    """This rank's place (shard index, P, U), to check its position ids."""

    def batch(
        self, position_ids: torch.Tensor, document_ids: torch.Tensor | None, chunk_assignment: torch.Tensor | None
    ) -> SequenceBatch:
        assignment = None
        if chunk_assignment is not None:
            assignment = tuple(tuple(int(c) for c in row) for row in chunk_assignment.reshape(chunk_assignment.shape[0], -1).tolist())
        docs, ok = None, True
        if document_ids is not None:
            docs = BatchDocuments(starts=document_starts(document_ids), seq_len=document_ids.shape[-1])
            want = shard_sequence(document_positions(document_ids.cpu()), dim=1, index=self.spec.index,
                                  sp_size=self.spec.sp_size, ulysses_degree=self.spec.ulysses_degree,
                                  scheme=self.spec.scheme, assignment=assignment)
            ok = want.shape == position_ids.shape and bool((want == position_ids.cpu()).all())
        sig = torch.cat([
            _signature(document_ids) if document_ids is not None else torch.zeros(3, dtype=torch.int64),
            _signature(chunk_assignment) if chunk_assignment is not None else torch.zeros(3, dtype=torch.int64),
            torch.tensor([int(ok)]),
        ])
        with self.comm.phase("data"):
            rows = self.comm.all_gather(self.comm.place(sig.cpu()), self.group, kind="check").cpu()
        if not bool((rows[:, :6] == rows[0, :6]).all()):
            raise ValueError(
                "the ranks of a sequence-parallel group received different document_ids or chunk_assignment: every "
                "rank of the group must get the same full batch (use the sequence-parallel loader)"
            )
        bad = [i for i, r in enumerate(rows.tolist()) if not r[6]]
        if bad:
            raise ValueError(
                f"position ids on sequence-parallel rank(s) {bad} are not the positions inside the documents of "
                "document_ids (they restart at 0 at each document): build packed batches with the sequence-parallel "
                "loader, which shards position_ids, labels and documents together"
            )
        return SequenceBatch(documents=docs, assignment=assignment)
