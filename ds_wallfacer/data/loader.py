"""The sequence-parallel data loader (the paper's dataloader component).

Turns batches of full sequences into this rank's shard: ``input_ids``, global ``position_ids`` and
``shift_labels`` (labels shifted BEFORE sharding, so no label crosses a shard boundary; ignored positions are
``ignore_index``). Every rank of a sequence-parallel group must see the same full batch; data-parallel
replicas see different ones.

Which pieces of a sequence each rank holds (zigzag / contiguous chunks of 2P, with Ulysses pieces, or an
explicit chunk assignment) is ``pieces.py``. Packed batches (several documents per row, ``packing.py``) get
per-document positions and labels and their ``document_starts``; under ``scheme="balanced"`` their chunks are
chosen by attention work (``balance.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from .balance import balanced_assignment, zigzag_assignment
from .chunks import DEFAULT_CHUNKS_PER_RANK, padded_length
from .collate import collate_right_padded
from .media import MEDIA_KEYS, TOKEN_TYPES_KEY, VisionAdapter
from .packing import (
    SPANS_KEY,
    document_ids,
    document_lengths_from_position_ids,
    document_positions,
    document_starts,
    mask_document_ends,
    normalize_document_lengths,
    normalize_spans,
    span_tensor,
    starts_of,
)
from .pieces import check_sequence_length, sequence_chunk_ids, sequence_position_ids, shard_sequence, unshard_sequence
from .steps import balanced_order, check_rounds, row_work

__all__ = [
    "TEXT_KEYS",
    "BalancedStepSampler",
    "SequenceParallelLoader",
    "ShardSpec",
    "collate_right_padded",
    "item_work",
    "prepare_batch",
    "sequence_chunk_ids",
    "sequence_position_ids",
    "shard_sequence",
    "unshard_sequence",
]

TEXT_KEYS = frozenset({"input_ids", "labels", "shift_labels", "attention_mask", "position_ids", "document_lengths"})
"""The keys of a full batch the loader shards; with a vision-language model's adapter also ``MEDIA_KEYS`` and
``TOKEN_TYPES_KEY``. Any other key is refused (it would not reach the model)."""


@dataclass(frozen=True)
class ShardSpec:
    """Where this rank's data comes from: its place in the sequence-parallel group and among replicas."""

    index: int
    """Sequence-parallel index i = r * U + u."""
    sp_size: int
    """P."""
    ulysses_degree: int = 1
    """U."""
    scheme: str = "zigzag"
    """Chunk layout over the ring dimension."""
    dp_rank: int = 0
    """Data-parallel replica of this rank."""
    dp_size: int = 1
    """Data-parallel replicas."""
    chunks_per_rank: int = DEFAULT_CHUNKS_PER_RANK
    """Chunks per ring rank under ``scheme="balanced"`` for packed batches (more: better balance, shorter
    kernel calls); unused by the other schemes."""

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.sp_size or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"invalid shard spec {self}")
        if self.chunks_per_rank < 1:
            raise ValueError(f"chunks_per_rank = {self.chunks_per_rank} is invalid: give a positive integer")
        sequence_chunk_ids(self.index, sp_size=self.sp_size, ulysses_degree=self.ulysses_degree, scheme=self.scheme)


def _as_2d(x: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"{name} must be [batch, seq_len] (or [seq_len]); got shape {tuple(t.shape)}")
    return t


def _right_padding_mask(batch: Mapping[str, Any]) -> torch.Tensor | None:
    if "attention_mask" not in batch:
        return None
    mask = _as_2d(batch["attention_mask"], "attention_mask")
    if ((mask != 0) & (mask != 1)).any() or (mask[:, 1:] > mask[:, :-1]).any():
        raise ValueError(
            "attention_mask must be 1 for tokens followed only by 0 for right padding; left padding and "
            "holes are not supported with sequence parallelism (the causal mask is never materialised)"
        )
    return mask


def _documents(batch: Mapping[str, Any], mask: torch.Tensor | None, shape: torch.Size) -> list[list[int]] | None:
    """Per row its documents' lengths when the batch is packed (``position_ids`` / ``document_lengths``)."""
    if "position_ids" not in batch and "document_lengths" not in batch:
        return None
    real = mask.sum(dim=1).tolist() if mask is not None else [shape[1]] * shape[0]
    docs = None
    if "document_lengths" in batch:
        docs = normalize_document_lengths(batch["document_lengths"], real_lengths=real)
    if "position_ids" in batch:
        pos = _as_2d(batch["position_ids"], "position_ids")
        if pos.shape != shape:
            raise ValueError(f"position_ids shape {tuple(pos.shape)} != input_ids shape {tuple(shape)}")
        from_pos = document_lengths_from_position_ids(pos, real_lengths=real)
        if docs is not None and docs != from_pos:
            b = next(i for i, (x, y) in enumerate(zip(docs, from_pos)) if x != y)
            raise ValueError(
                f"row {b}: document_lengths {docs[b]} disagree with the documents of position_ids {from_pos[b]}; "
                "give one of the two"
            )
        docs = from_pos
    return docs


def _spans(value: Any, mask: torch.Tensor | None, shape: torch.Size, starts: torch.Tensor | None,
           n: int) -> torch.Tensor:
    """The batch's bidirectional spans as [B, S, 2] int64, checked against the rows and their documents (the
    attention's own check, ``BatchDocuments``, here at the loader with the row named)."""
    from ..attention.documents import BatchDocuments

    real = mask.sum(dim=1).tolist() if mask is not None else [shape[1]] * shape[0]
    spans = normalize_spans(value, real_lengths=real)
    BatchDocuments(starts=starts_of(starts, n) if starts is not None else ((0,),) * shape[0], seq_len=n,
                   spans=tuple(tuple(r) for r in spans))
    return span_tensor(spans, seq_len=n)


def _batch_spans(batch: Mapping[str, Any], vision: VisionAdapter | None, docs: list[list[int]] | None,
                 mask: torch.Tensor | None, n: int) -> Any:
    """The batch's ``bidirectional_spans``, or those a model derives from its token types (Gemma 3's images,
    PaliGemma's prefix: ``adapters/type_spans.py``), per document; None when it has none."""
    ts = getattr(vision, "type_spans", None)
    if ts is None or batch.get(ts.key) is None:
        return batch.get(SPANS_KEY)
    if batch.get(SPANS_KEY) is not None:
        raise ValueError(f"give {ts.key} or {SPANS_KEY}, not both: {ts.model} derives its spans from {ts.key}")
    types = _as_2d(batch[ts.key], ts.key)
    if types.shape[1] != n or types.shape[0] != (mask.shape[0] if mask is not None else types.shape[0]):
        raise ValueError(f"{ts.key} shape {tuple(types.shape)} does not match input_ids (length {n})")
    real = mask.sum(dim=1).tolist() if mask is not None else [n] * types.shape[0]
    starts = [[sum(d[:i]) for i in range(len(d))] for d in docs] if docs is not None else [[0]] * len(real)
    return ts.spans(types, starts=starts, real_lengths=real)


def _checked_ids(batch: Mapping[str, Any], vision: VisionAdapter | None = None) -> torch.Tensor:
    """``input_ids`` [B, N] as int64, after checking the batch's keys and the shapes beside it."""
    if "input_ids" not in batch:
        raise ValueError(f"a batch needs 'input_ids'; got keys {sorted(batch)}")
    known = {*TEXT_KEYS, SPANS_KEY}
    refused = sorted(set(batch) & set(getattr(vision, "refused_keys", None) or {}))
    if refused:  # what the model's adapter refuses by name (the Omni thinkers' audio)
        raise ValueError(vision.refused_keys[refused[0]])
    media = sorted(set(batch) & {*MEDIA_KEYS, TOKEN_TYPES_KEY})
    if media and getattr(vision, "refusal", None):
        raise ValueError(vision.refusal)
    if media and vision is None:
        raise ValueError(f"batch keys {media} (images or videos) are not supported here: they need a vision-language "
                         "model ds_wallfacer adapts, sharded by sp.dataloader / sp.shard (dynamic sequence "
                         "parallelism takes text rows only)")
    if vision is not None:
        known |= {*MEDIA_KEYS, TOKEN_TYPES_KEY}
    if getattr(vision, "type_spans", None) is not None:
        known.add(vision.type_spans.key)
    unknown = sorted(set(batch) - known)
    if unknown:
        raise ValueError(f"batch keys {unknown} are not supported by the sequence-parallel loader; known: {sorted(known)}")
    ids = _as_2d(batch["input_ids"], "input_ids").long()
    if "labels" in batch and "shift_labels" in batch:
        raise ValueError("give labels (unshifted) or shift_labels (already shifted), not both")
    for key in ("labels", "shift_labels", "attention_mask"):
        if key in batch and _as_2d(batch[key], key).shape != ids.shape:
            raise ValueError(f"{key} shape {tuple(_as_2d(batch[key], key).shape)} != input_ids shape {tuple(ids.shape)}")
    return ids


def _shift_labels(batch: Mapping[str, Any], ids: torch.Tensor, mask: torch.Tensor | None, *,
                  ignore_index: int) -> torch.Tensor:
    """[B, N] targets: position i predicts token i + 1 (``labels`` or ``input_ids``, padding ignored); the last
    position has none. ``shift_labels`` given: as they are."""
    if "shift_labels" in batch:
        return _as_2d(batch["shift_labels"], "shift_labels").long().clone()
    labels = _as_2d(batch["labels"], "labels").long().clone() if "labels" in batch else ids.clone()
    if mask is not None:
        labels = labels.masked_fill(mask == 0, ignore_index)
    return F.pad(labels[:, 1:], (0, 1), value=ignore_index)


def prepare_batch(
    batch: Mapping[str, Any],
    spec: ShardSpec,
    *,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    pad: bool = True,
    vision: VisionAdapter | None = None,
) -> dict[str, torch.Tensor]:
    """A batch of full sequences -> this rank's ``input_ids``, ``position_ids``, ``shift_labels`` [B, N / P].

    ``batch``: ``input_ids`` [B, N]; optional ``labels`` (HF convention: unshifted, ``ignore_index`` = no
    target; default = input_ids) or ``shift_labels`` (already shifted), optional ``attention_mask`` (1 = token,
    0 = right padding). N is padded on the right to a multiple of 2P (``pad=False``: a clear error instead).
    With padding of either kind, also ``token_mask`` [B, N / P] (1 = real token) and ``sequence_length`` [B, N / P]
    (N before the loader's padding), for the loss module's MoE router statistics and length-reading RoPE.

    Packed batches (Note [Packed documents] in docs/design/documents.md) also carry ``position_ids`` [B, N] restarting
    at 0 at each document, or ``document_lengths``. Then ``position_ids`` are positions inside each document, the
    label of each document's last token is ``ignore_index``, and ``document_starts`` [B, D] int64 holds every row's
    document starts (global, right padding one more document, the tail filled with N_padded), the same on every
    rank: the attention's whole view of the documents, a few numbers per document.

    ``bidirectional_spans`` (``SPANS_KEY``): per row (start, end) token ranges whose tokens attend to each other
    both ways, each inside one document (Note [Bidirectional spans] in docs/design/spans.md; ``normalize_spans``); the
    output carries them as [B, S, 2] int64, the same on every rank, beside ``document_starts`` (or from the
    ``token_type_ids`` of a model that derives them: ``vision.type_spans``, Gemma 3 and PaliGemma).

    ``spec.scheme == "balanced"``: a packed batch is cut into R x ``spec.chunks_per_rank`` ring chunks
    (R = P / U; N padded to a multiple of P x chunks_per_rank) assigned by attention work (one without documents:
    zigzag); ``chunk_assignment`` [R, chunks per rank] int64 says which ring chunks each ring rank holds, ascending.

    ``vision``: the model's adapter (``adapters/vision.py``) for images and videos (``MEDIA_KEYS``), whose
    ``mrope_position_ids`` [3, B, N / P] and ``media_index`` ``_media_fields`` adds; ``vision.refusal`` refuses them.
    """
    ids = _checked_ids(batch, vision)
    mask = _right_padding_mask(batch)
    docs = _documents(batch, mask, ids.shape)
    shift = _shift_labels(batch, ids, mask, ignore_index=ignore_index)
    n_in = ids.shape[1]
    # tokens the model attends to (HF counts only these in e.g. an MoE router's aux loss); 0 = padding
    keep = mask.long() if mask is not None else None
    balanced = spec.scheme == "balanced" and docs is not None
    ids, shift, keep = _padded(ids, shift, keep, spec, unit=spec.sp_size * spec.chunks_per_rank if balanced else None,
                               pad=pad, pad_token_id=pad_token_id, ignore_index=ignore_index)
    n = ids.shape[1]
    kw: dict[str, Any] = dict(dim=1, index=spec.index, sp_size=spec.sp_size, ulysses_degree=spec.ulysses_degree,
                              scheme=spec.scheme)
    extra: dict[str, torch.Tensor] = {}
    if docs is None:
        pos = torch.arange(n).expand(ids.shape[0], n)
    else:
        doc_ids = document_ids(docs, seq_len=n)
        pos = document_positions(doc_ids)
        shift = mask_document_ends(shift, doc_ids, ignore_index=ignore_index)
        extra["document_starts"] = document_starts(docs, seq_len=n)
    if (spans := _batch_spans(batch, vision, docs, mask, n_in)) is not None:
        extra[SPANS_KEY] = _spans(spans, mask, ids.shape, extra.get("document_starts"), n)
    if spec.scheme == "balanced":
        assignment = _chunk_assignment(spec, docs if balanced else None, n)
        extra["chunk_assignment"] = torch.tensor(assignment, dtype=torch.int64)
        if balanced:
            kw["assignment"] = assignment
    out = {
        "input_ids": shard_sequence(ids, **kw).contiguous(),
        "position_ids": shard_sequence(pos, **kw).contiguous(),
        "shift_labels": shard_sequence(shift, **kw).contiguous(),
    }
    out.update(_media_fields(batch, ids, docs, vision, kw))
    if keep is not None and not bool(keep.all()):
        # only with padding: which local tokens are real, and the length the model would see without our padding
        out["token_mask"] = shard_sequence(keep, **kw).contiguous()
        out["sequence_length"] = torch.full_like(out["position_ids"], n_in)  # per token, sharded like the rest
    out.update(extra)
    return out


def _padded(ids: torch.Tensor, shift: torch.Tensor, keep: torch.Tensor | None, spec: ShardSpec, *, unit: int | None,
            pad: bool, pad_token_id: int, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(ids, shift, keep) right-padded to a multiple of ``unit`` (balanced chunks) or of 2P; ``keep`` becomes a
    mask when padding is added. ``pad=False`` or an empty row: the length is checked instead (a clear error)."""
    n = ids.shape[1]
    rem = (-(-n // unit) * unit if unit else padded_length(n, spec.sp_size)) - n
    if not rem and n:
        return ids, shift, keep
    if not pad or n == 0:
        check_sequence_length(n, spec.sp_size, pieces=unit)
    keep = F.pad(keep if keep is not None else torch.ones_like(ids), (0, rem), value=0)
    return F.pad(ids, (0, rem), value=pad_token_id), F.pad(shift, (0, rem), value=ignore_index), keep


def _chunk_assignment(spec: ShardSpec, docs: list[list[int]] | None, n: int) -> list:
    """The ring chunks each ring rank holds: by attention work for a packed batch (``docs``), else zigzag."""
    ring = spec.sp_size // spec.ulysses_degree
    if docs is None:
        return zigzag_assignment(ring)
    rows = [[*d, n - sum(d)] for d in docs]  # padding is one more document for the attention
    return balanced_assignment(rows, sp_size=ring, chunks_per_rank=spec.chunks_per_rank)


def _media_fields(batch: Mapping[str, Any], ids: torch.Tensor, docs: list[list[int]] | None, vision: VisionAdapter,
                  shard: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A batch with images or videos: each token's feature row and (M-RoPE models) the positions of the full (padded)
    rows, sharded like the tokens (``shard``: ``shard_sequence``'s keywords), and the media as they are; {} without."""
    media = {k: torch.as_tensor(batch[k]) for k in MEDIA_KEYS if batch.get(k) is not None}
    if not media:
        return {}
    types = vision.token_types(ids, batch.get(TOKEN_TYPES_KEY))
    out = {"media_index": shard_sequence(vision.media_index(types), **shard).contiguous(), **media}
    positions = vision.positions(ids, types, media, docs)
    if positions is not None:  # M-RoPE; None: image tokens are numbered like text (the loader's positions)
        out["mrope_position_ids"] = shard_sequence(positions, **{**shard, "dim": 2})
    return out


def item_work(item: Any) -> int:
    """Attention work of one map-style item (``collate_right_padded``'s forms): its documents' squares, from
    ``document_lengths`` or ``position_ids``; an item without them is one document."""
    row = item if isinstance(item, Mapping) else {"input_ids": item}
    n = int(torch.as_tensor(row["input_ids"]).numel())
    docs = _documents({k: row[k] for k in ("position_ids", "document_lengths") if k in row}, None, torch.Size([1, n]))
    return row_work(docs[0] if docs is not None else [n])


class BalancedStepSampler(torch.utils.data.Sampler):
    """Item indices in rounds whose micro-batches carry even attention work (``steps.py``): an epoch's items
    (shuffled with ``seed`` and the epoch when ``shuffle``) ordered by ``balanced_order``, replica ``dp_rank``
    taking its ``batch_size`` items of each round; ``dp_rank=None``: every replica's, round by round (batch j of
    ``batch_size`` then belongs to replica j mod ``dp_size``, as accelerate shards batches). Items past the last
    whole round are dropped."""

    def __init__(self, work: Sequence[int], *, batch_size: int, dp_rank: int | None, dp_size: int, shuffle: bool,
                 seed: int, window: int | None = None) -> None:
        self.work, self.batch_size, self.dp_rank, self.dp_size = list(work), batch_size, dp_rank, dp_size
        self.shuffle, self.seed, self.window, self.epoch = shuffle, seed, window, 0
        check_rounds(self.work, batch_size, dp_size, window)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        per = self.batch_size * (self.dp_size if self.dp_rank is None else 1)
        return len(self.work) // (self.batch_size * self.dp_size) * per

    def __iter__(self) -> Iterator[int]:
        items = list(range(len(self.work)))
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)  # DistributedSampler's seeding
            items = torch.randperm(len(items), generator=g).tolist()
        order = balanced_order([self.work[i] for i in items], per_replica=self.batch_size, replicas=self.dp_size,
                               seed=self.seed * 1_000_003 + self.epoch, window=self.window)
        if self.dp_rank is None:
            yield from (items[i] for i in order)
            return
        per_round, lo = self.batch_size * self.dp_size, self.dp_rank * self.batch_size
        for a in range(0, len(order), per_round):
            yield from (items[i] for i in order[a + lo : a + lo + self.batch_size])


class SequenceParallelLoader:
    """Wraps a map-style dataset, or any iterable of full batches (a DataLoader), and yields this rank's shards.

    - map-style (``__getitem__`` + ``__len__``): batches of ``batch_size`` items, right-padded; replicas take
      disjoint items (``DistributedSampler`` over the data-parallel replicas, seeded: the same on every rank).
      ``balance_steps``: the replicas' micro-batches of each round carry even attention work instead
      (``BalancedStepSampler``; every item is read once up front to weigh it; packed items weigh their documents)
    - iterable of batches: replica d takes batches d, d + D, d + 2D, ... (every rank must iterate the same
      sequence of batches; ``verify`` checks that within the sequence-parallel group)

    ``verify(batch) -> None``: called with each full batch before sharding (the integration passes a check that
    all sequence-parallel ranks hold the same batch, so a diverging data pipeline fails loudly).
    """

    def __init__(
        self,
        source: Any,
        spec: ShardSpec,
        *,
        batch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = True,
        pad_token_id: int = 0,
        ignore_index: int = -100,
        pad: bool = True,
        verify: Callable[[Mapping[str, torch.Tensor]], None] | None = None,
        balance_steps: bool = False,
        vision: VisionAdapter | None = None,
    ) -> None:
        self.spec, self.pad_token_id, self.ignore_index, self.pad, self.verify = (
            spec, pad_token_id, ignore_index, pad, verify
        )
        self.vision = vision
        """The model's vision-language adapter for batches with images (``prepare_batch``), else None."""
        self._epoch = 0
        self._batches: Iterable[Mapping[str, Any]]
        if hasattr(source, "__getitem__") and hasattr(source, "__len__") and not isinstance(source, torch.utils.data.DataLoader):
            from torch.utils.data import DataLoader, DistributedSampler

            if balance_steps:
                if not drop_last:
                    raise ValueError("balance_steps=True trains whole rounds only: give drop_last=True")
                self._sampler = BalancedStepSampler(
                    [item_work(source[i]) for i in range(len(source))], batch_size=batch_size,
                    dp_rank=spec.dp_rank, dp_size=spec.dp_size, shuffle=shuffle, seed=seed,
                )
            else:
                self._sampler = DistributedSampler(
                    source, num_replicas=spec.dp_size, rank=spec.dp_rank, shuffle=shuffle, seed=seed,
                    drop_last=drop_last,
                )
            keys = (vision.type_spans.key,) if getattr(vision, "type_spans", None) is not None else ()
            self._batches = DataLoader(
                source, batch_size=batch_size, sampler=self._sampler, drop_last=drop_last,
                collate_fn=lambda items: collate_right_padded(items, pad_token_id=pad_token_id,
                                                              ignore_index=ignore_index, token_keys=keys),
            )
            self._strided = False
        else:
            if balance_steps:
                raise ValueError(
                    "balance_steps=True needs a map-style dataset (__getitem__ and __len__) to weigh every item up "
                    "front; an iterable of batches is taken as it comes (the trainer balances its own rows with "
                    "--balance_steps)"
                )
            self._sampler = None
            self._batches = source
            self._strided = True

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for a new epoch (map-style sources)."""
        self._epoch = epoch
        if self._sampler is not None:
            self._sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n = len(self._batches)  # type: ignore[arg-type]
        if not self._strided:
            return n
        d, r = self.spec.dp_size, self.spec.dp_rank
        return n // d + (1 if r < n % d else 0)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for i, batch in enumerate(self._batches):
            if self._strided and i % self.spec.dp_size != self.spec.dp_rank:
                continue
            if not isinstance(batch, Mapping):
                batch = {"input_ids": batch}
            if self.verify is not None:
                self.verify(batch)
            yield prepare_batch(
                batch, self.spec, pad_token_id=self.pad_token_id, ignore_index=self.ignore_index, pad=self.pad,
                vision=self.vision,
            )
