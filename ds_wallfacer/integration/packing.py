"""Packed batches at the model's forward: the loader's ``document_starts`` / ``chunk_assignment`` /
``bidirectional_spans`` turned into what attention needs (``attention.documents.SequenceBatch``), handed down as the
forward keyword ``wallfacer_batch`` (``BATCH_KWARG``) and checked across the sequence-parallel group by one small
all-gather per step.

The documents travel as their starts, a few numbers per document ([B, D]), the spans as theirs ([B, S, 2]): nothing
sequence-long is rebuilt or copied to the host per step. The check that this rank's position ids restart at each
document runs where they are.

Design: Note [Packed documents] in docs/design/documents.md; Note [Bidirectional spans] in docs/design/spans.md.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention.documents import BatchDocuments, SequenceBatch
from ..comm import CommLayer
from ..data.loader import ShardSpec
from ..data.packing import spans_of, starts_of
from ..data.pieces import sequence_position_ids
from ..adapters.hf import BATCH_KWARG

__all__ = ["BATCH_KWARG", "PackedBatches"]


def _signature(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1).long()
    w = torch.arange(1, x.numel() + 1, dtype=torch.int64, device=x.device) % 1_000_003
    return torch.stack([x.new_tensor(x.numel()), (x * w).sum(), x.sum()])


@functools.lru_cache(maxsize=8)
def _global_index(n: int, spec: ShardSpec, assignment, device: torch.device) -> torch.Tensor:
    """[N / P] global index of each of this rank's tokens, on ``device`` (once per layout)."""
    return sequence_position_ids(n, index=spec.index, sp_size=spec.sp_size, ulysses_degree=spec.ulysses_degree,
                                 scheme=spec.scheme, assignment=assignment).to(device)


def positions_agree(position_ids: torch.Tensor, document_starts: torch.Tensor, global_index: torch.Tensor) -> bool:
    """Whether ``position_ids`` [B, N / P] are each token's position inside its document, for the documents of
    ``document_starts`` [B, D] and the tokens' global indices [N / P]; computed on the position ids' device."""
    starts = document_starts.to(position_ids.device, torch.int64)
    g = global_index.expand(position_ids.shape[0], -1).contiguous()
    doc = torch.searchsorted(starts, g, right=True) - 1
    return bool((g - starts.gather(1, doc) == position_ids).all())


@dataclass
class PackedBatches:
    """Builds and checks the ``SequenceBatch`` of each packed forward on this rank."""

    group: dist.ProcessGroup
    """The sequence-parallel group (whose ranks must agree)."""
    comm: CommLayer
    spec: ShardSpec
    """This rank's place (shard index, P, U), to check its position ids."""

    def batch(
        self, position_ids: torch.Tensor, document_starts: torch.Tensor | None, chunk_assignment: torch.Tensor | None,
        bidirectional_spans: torch.Tensor | None = None,
    ) -> SequenceBatch:
        """``bidirectional_spans`` [B, S, 2] (the loader's): a row's spans, with or without packed documents (a row
        without them is one document)."""
        # what every rank of the group must agree on, signed first (on the host, like the rest of ``sig``: the
        # comm layer places it on the group's device); then this rank's own position check
        n = position_ids.shape[-1] * self.spec.sp_size
        starts_host = document_starts.cpu() if document_starts is not None else None  # [B, D]: small
        spans_host = bidirectional_spans.cpu() if bidirectional_spans is not None else None  # [B, S, 2]: small
        signed = [_signature(x.cpu()) if x is not None else torch.zeros(3, dtype=torch.int64)
                  for x in (starts_host, chunk_assignment, spans_host)]
        assignment = None
        if chunk_assignment is not None:
            rows_of = chunk_assignment.reshape(chunk_assignment.shape[0], -1).tolist()
            assignment = tuple(tuple(int(c) for c in row) for row in rows_of)
        ok = True
        if document_starts is not None:
            index = _global_index(n, self.spec, assignment, position_ids.device)
            ok = positions_agree(position_ids, document_starts, index)
        sig = torch.cat([*signed, torch.tensor([int(ok)])])
        with self.comm.phase("data"):
            rows = self.comm.all_gather(self.comm.place(sig.cpu()), self.group, kind="check").cpu()
        if not bool((rows[:, :9] == rows[0, :9]).all()):
            raise ValueError(
                "the ranks of a sequence-parallel group received different document_starts, chunk_assignment or "
                "bidirectional_spans: every rank of the group must get the same full batch (use the "
                "sequence-parallel loader)"
            )
        bad = [i for i, r in enumerate(rows.tolist()) if not r[9]]
        if bad:
            raise ValueError(
                f"position ids on sequence-parallel rank(s) {bad} are not the positions inside the documents of "
                "document_starts (they restart at 0 at each document): build packed batches with the "
                "sequence-parallel loader, which shards position_ids, labels and documents together"
            )
        docs = None  # checked once every rank has the same: all raise together, none waits in a collective
        spans = spans_of(spans_host) if spans_host is not None else None
        if document_starts is not None or spans is not None:
            starts = starts_of(starts_host, n) if starts_host is not None else ((0,),) * position_ids.shape[0]
            docs = BatchDocuments(starts=starts, seq_len=n, spans=spans)
        return SequenceBatch(documents=docs, assignment=assignment)
