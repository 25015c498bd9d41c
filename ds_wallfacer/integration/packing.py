"""Packed batches at the model's forward: the loader's ``document_ids`` / ``chunk_assignment`` turned into what
attention needs (``attention.documents.SequenceBatch``), handed down as the forward keyword ``wallfacer_batch``
(``BATCH_KWARG``) and checked across the sequence-parallel group by one small all-gather per step.

Design: Note [Packed documents] in docs/design.md §2.2.
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
        # what every rank of the group must agree on, signed first (on the host, like the rest of ``sig``: the
        # comm layer places it on the group's device); then this rank's own position check
        doc_host = document_ids.cpu() if document_ids is not None else None
        signed = [_signature(x.cpu()) if x is not None else torch.zeros(3, dtype=torch.int64)
                  for x in (doc_host, chunk_assignment)]
        assignment = None
        if chunk_assignment is not None:
            rows_of = chunk_assignment.reshape(chunk_assignment.shape[0], -1).tolist()
            assignment = tuple(tuple(int(c) for c in row) for row in rows_of)
        docs, ok = None, True
        if document_ids is not None:
            docs = BatchDocuments(starts=document_starts(document_ids), seq_len=document_ids.shape[-1])
            want = shard_sequence(document_positions(doc_host), dim=1, index=self.spec.index,
                                  sp_size=self.spec.sp_size, ulysses_degree=self.spec.ulysses_degree,
                                  scheme=self.spec.scheme, assignment=assignment)
            ok = want.shape == position_ids.shape and bool((want == position_ids.cpu()).all())
        sig = torch.cat([*signed, torch.tensor([int(ok)])])
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
