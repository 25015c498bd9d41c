"""The sequence-parallel data loader (the paper's dataloader component).

Turns batches of full sequences into this rank's shard: ``input_ids``, global ``position_ids`` and
``shift_labels`` (labels shifted BEFORE sharding, so no label crosses a shard boundary; ignored positions are
``ignore_index``). Every rank of a sequence-parallel group must see the same full batch; data-parallel
replicas see different ones.

Sequence layout: a sequence of N tokens is cut into 2P pieces; sequence-parallel rank ``i = r * U + u``
(U = Ulysses degree, R = P / U ring ranks) holds pieces ``a*U + u`` and ``b*U + u`` where (a, b) are ring
rank r's two chunks of 2R under ``scheme`` (zigzag: (r, 2R-1-r); contiguous: (2r, 2r+1)). U = 1 is the plain
WallFacer layout of ``sharding.py``; after the Ulysses all-to-all a ring rank holds its chunks in order
(``attention/hybrid.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F

from .chunks import check_divisible, chunk_ids, padded_length

__all__ = [
    "SequenceParallelLoader",
    "ShardSpec",
    "collate_right_padded",
    "prepare_batch",
    "sequence_chunk_ids",
    "sequence_position_ids",
    "shard_sequence",
    "unshard_sequence",
]


def sequence_chunk_ids(index: int, *, sp_size: int, ulysses_degree: int = 1, scheme: str = "zigzag") -> tuple[int, int]:
    """The two pieces (of 2P) held by sequence-parallel rank ``index``, in local order."""
    u = ulysses_degree
    if u < 1 or sp_size % u:
        raise ValueError(f"ulysses_degree {u} must divide sequence_parallel_size {sp_size}")
    ring, sub = divmod(index, u)
    a, b = chunk_ids(ring, sp_size // u, scheme)
    return (a * u + sub, b * u + sub)


def _check_len(n: int, sp_size: int) -> None:
    check_divisible(n, sp_size)


def shard_sequence(
    x: torch.Tensor, *, dim: int, index: int, sp_size: int, ulysses_degree: int = 1, scheme: str = "zigzag"
) -> torch.Tensor:
    """Full sequence along ``dim`` -> rank ``index``'s two pieces, concatenated."""
    _check_len(x.shape[dim], sp_size)
    pieces = x.chunk(2 * sp_size, dim=dim)
    ids = sequence_chunk_ids(index, sp_size=sp_size, ulysses_degree=ulysses_degree, scheme=scheme)
    return torch.cat([pieces[i] for i in ids], dim=dim)


def unshard_sequence(
    shards: Sequence[torch.Tensor], *, dim: int, ulysses_degree: int = 1, scheme: str = "zigzag"
) -> torch.Tensor:
    """The shards of all P ranks (in index order) -> the full sequence."""
    p = len(shards)
    pieces: dict[int, torch.Tensor] = {}
    for i, s in enumerate(shards):
        ids = sequence_chunk_ids(i, sp_size=p, ulysses_degree=ulysses_degree, scheme=scheme)
        for c, piece in zip(ids, s.chunk(2, dim=dim)):
            pieces[c] = piece
    return torch.cat([pieces[c] for c in range(2 * p)], dim=dim)


def sequence_position_ids(
    seq_len: int, *, index: int, sp_size: int, ulysses_degree: int = 1, scheme: str = "zigzag"
) -> torch.Tensor:
    """Global position ids of rank ``index``'s tokens, [seq_len / P] (RoPE needs global positions)."""
    return shard_sequence(
        torch.arange(seq_len), dim=0, index=index, sp_size=sp_size, ulysses_degree=ulysses_degree, scheme=scheme
    )


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

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.sp_size or not 0 <= self.dp_rank < self.dp_size:
            raise ValueError(f"invalid shard spec {self}")
        sequence_chunk_ids(self.index, sp_size=self.sp_size, ulysses_degree=self.ulysses_degree, scheme=self.scheme)


def _as_2d(x: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise ValueError(f"{name} must be [batch, seq_len] (or [seq_len]); got shape {tuple(t.shape)}")
    return t


def prepare_batch(
    batch: Mapping[str, Any],
    spec: ShardSpec,
    *,
    pad_token_id: int = 0,
    ignore_index: int = -100,
    pad: bool = True,
) -> dict[str, torch.Tensor]:
    """A batch of full sequences -> this rank's ``input_ids``, ``position_ids``, ``shift_labels`` [B, N / P].

    ``batch``: ``input_ids`` [B, N]; optional ``labels`` (HF convention: unshifted, ``ignore_index`` = no
    target; default = input_ids) or ``shift_labels`` (already shifted), optional ``attention_mask`` (1 = token,
    0 = right padding). N is padded on the right to a multiple of 2P (``pad=False``: a clear error instead).
    With padding of either kind, also ``token_mask`` [B, N / P] (1 = real token) and ``sequence_length`` [B, N / P]
    (N before the loader's padding), which the loss module uses for MoE router statistics and length-reading RoPE.
    """
    if "input_ids" not in batch:
        raise ValueError(f"a batch needs 'input_ids'; got keys {sorted(batch)}")
    known = {"input_ids", "labels", "shift_labels", "attention_mask"}
    unknown = sorted(set(batch) - known)
    if unknown:
        raise ValueError(f"batch keys {unknown} are not supported by the sequence-parallel loader; known: {sorted(known)}")
    ids = _as_2d(batch["input_ids"], "input_ids").long()
    if "labels" in batch and "shift_labels" in batch:
        raise ValueError("give labels (unshifted) or shift_labels (already shifted), not both")
    for key in ("labels", "shift_labels", "attention_mask"):
        if key in batch and _as_2d(batch[key], key).shape != ids.shape:
            raise ValueError(f"{key} shape {tuple(_as_2d(batch[key], key).shape)} != input_ids shape {tuple(ids.shape)}")
    if "shift_labels" in batch:
        shift = _as_2d(batch["shift_labels"], "shift_labels").long().clone()
    else:
        labels = _as_2d(batch["labels"], "labels").long().clone() if "labels" in batch else ids.clone()
        if "attention_mask" in batch:
            mask = _as_2d(batch["attention_mask"], "attention_mask")
            if ((mask != 0) & (mask != 1)).any() or (mask[:, 1:] > mask[:, :-1]).any():
                raise ValueError(
                    "attention_mask must be 1 for tokens followed only by 0 for right padding; left padding and "
                    "holes are not supported with sequence parallelism (the causal mask is never materialised)"
                )
            labels = labels.masked_fill(mask == 0, ignore_index)
        # [B, N] -> [B, N]: position i predicts token i + 1; the last position has no target
        shift = F.pad(labels[:, 1:], (0, 1), value=ignore_index)
    n = n_in = ids.shape[1]
    # tokens the model attends to (HF counts only these in e.g. an MoE router's aux loss); 0 = padding
    keep = _as_2d(batch["attention_mask"], "attention_mask").long() if "attention_mask" in batch else None
    rem = padded_length(n, spec.sp_size) - n
    if rem or n == 0:
        if not pad or n == 0:
            _check_len(n, spec.sp_size)
        ids = F.pad(ids, (0, rem), value=pad_token_id)
        shift = F.pad(shift, (0, rem), value=ignore_index)
        keep = F.pad(keep if keep is not None else torch.ones_like(ids[:, :n]), (0, rem), value=0)
        n += rem
    pos = torch.arange(n).expand(ids.shape[0], n)
    kw = dict(dim=1, index=spec.index, sp_size=spec.sp_size, ulysses_degree=spec.ulysses_degree, scheme=spec.scheme)
    out = {
        "input_ids": shard_sequence(ids, **kw).contiguous(),
        "position_ids": shard_sequence(pos, **kw).contiguous(),
        "shift_labels": shard_sequence(shift, **kw).contiguous(),
    }
    if keep is not None and not bool(keep.all()):
        # only with padding: which local tokens are real, and the length the model would see without our padding
        out["token_mask"] = shard_sequence(keep, **kw).contiguous()
        out["sequence_length"] = torch.full_like(out["position_ids"], n_in)  # per token, sharded like the rest
    return out


def collate_right_padded(
    items: Sequence[Any], *, pad_token_id: int = 0, ignore_index: int = -100
) -> dict[str, torch.Tensor]:
    """Map-style items (a 1-D tensor / list of token ids, or a dict with ``input_ids`` and optional
    ``labels``) -> one batch, right-padded to the longest item with an ``attention_mask``."""
    rows = [it if isinstance(it, Mapping) else {"input_ids": it} for it in items]
    ids = [torch.as_tensor(r["input_ids"]).long().reshape(-1) for r in rows]
    n = max(len(x) for x in ids)
    out = {
        "input_ids": torch.stack([F.pad(x, (0, n - len(x)), value=pad_token_id) for x in ids]),
        "attention_mask": torch.stack([F.pad(torch.ones_like(x), (0, n - len(x))) for x in ids]),
    }
    if any("labels" in r for r in rows):
        labels = [torch.as_tensor(r.get("labels", x)).long().reshape(-1) for r, x in zip(rows, ids)]
        out["labels"] = torch.stack([F.pad(y, (0, n - len(y)), value=ignore_index) for y in labels])
    return out


class SequenceParallelLoader:
    """Wraps a map-style dataset, or any iterable of full batches (a DataLoader), and yields this rank's shards.

    - map-style (``__getitem__`` + ``__len__``): batches of ``batch_size`` items, right-padded; replicas take
      disjoint items (``DistributedSampler`` over the data-parallel replicas, seeded: the same on every rank)
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
    ) -> None:
        self.spec, self.pad_token_id, self.ignore_index, self.pad, self.verify = (
            spec, pad_token_id, ignore_index, pad, verify
        )
        self._epoch = 0
        self._batches: Iterable[Mapping[str, Any]]
        if hasattr(source, "__getitem__") and hasattr(source, "__len__") and not isinstance(source, torch.utils.data.DataLoader):
            from torch.utils.data import DataLoader, DistributedSampler

            self._sampler = DistributedSampler(
                source, num_replicas=spec.dp_size, rank=spec.dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last
            )
            self._batches = DataLoader(
                source, batch_size=batch_size, sampler=self._sampler, drop_last=drop_last,
                collate_fn=lambda items: collate_right_padded(items, pad_token_id=pad_token_id, ignore_index=ignore_index),
            )
            self._strided = False
        else:
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
                batch, self.spec, pad_token_id=self.pad_token_id, ignore_index=self.ignore_index, pad=self.pad
            )
