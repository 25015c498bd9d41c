"""Training data: local text files read with HF ``datasets``, tokenised once (cached), cut into sequences.

Sources: ``.txt`` (one document per file), ``.jsonl`` / ``.parquet`` (one document per row, column
``--text_field``), a folder of such files (recursively, sorted), or a ``datasets.save_to_disk`` folder. Nothing is
fetched from a hub. Documents are joined with the EOS token into one stream and cut into ``seq_len`` sequences
(the tail shorter than a sequence is dropped); the last ``eval_fraction`` of the sequences is held out.

Design: Note [Token cache and data order] in docs/design/training.md (the cache key, who builds it, the epoch order).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..data.steps import balanced_order, row_work
from .cli import StartupError
from .conversations import ConversationRows, eval_rounds, is_conversation_file, load_conversations, load_processor

__all__ = ["SUFFIXES", "TokenData", "eval_batches", "find_sources", "load_data", "load_token_data", "row_works",
           "token_rows", "train_batches"]

SUFFIXES = (".txt", ".jsonl", ".parquet")
_CACHE_VERSION = 1


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file())


def find_sources(path: str | Path) -> tuple[str, list[Path]]:
    """("saved", [folder]) for a ``save_to_disk`` folder, else ("files", sorted data files)."""
    p = Path(path)
    if _is_saved_dataset(p):
        return "saved", [p]
    if p.is_file():
        if p.suffix not in SUFFIXES:
            raise StartupError(f"--data {str(p)!r}: unsupported file type {p.suffix!r}; use {', '.join(SUFFIXES)}")
        return "files", [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
    if not files:
        raise StartupError(f"--data {str(p)!r} holds no {'/'.join(SUFFIXES)} files and is not a "
                           "datasets.save_to_disk folder: the data set is empty")
    return "files", files


def _read_texts(kind: str, paths: list[Path], *, text_field: str, scratch: str) -> Iterator[str]:
    """Documents in order. ``scratch``: a private folder for ``datasets``' Arrow files (no sharing between ranks)."""
    import datasets

    datasets.disable_progress_bars()
    if kind == "saved":
        ds = datasets.load_from_disk(str(paths[0]))
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else sorted(ds)[0]
            ds = ds[split]
        yield from _column(ds, text_field, paths[0])
        return
    builders = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
    for f in paths:
        kw: dict[str, Any] = {"sample_by": "document"} if f.suffix == ".txt" else {}
        ds = datasets.load_dataset(builders[f.suffix], data_files=[str(f)], split="train", cache_dir=scratch, **kw)
        yield from _column(ds, "text" if f.suffix == ".txt" else text_field, f)


def _column(ds: Any, field: str, where: Path) -> Iterator[str]:
    if len(ds) == 0:
        return
    if field not in ds.column_names:
        raise StartupError(f"--data {str(where)!r} has no column {field!r} (columns: {ds.column_names}): set "
                           "--text_field")
    for i in range(0, len(ds), 1000):
        yield from (t for t in ds[i : i + 1000][field] if t)


def _cache_key(kind: str, paths: list[Path], *, tokenizer_id: str, seq_len: int, text_field: str, eos_id: int) -> str:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()))]
    ident = {
        "version": _CACHE_VERSION, "kind": kind, "tokenizer": tokenizer_id, "seq_len": seq_len,
        "text_field": text_field, "eos": eos_id,
        "files": [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]


def _tokenize(texts: Iterator[str], tokenizer: Any, *, tokenizer_id: str, eos_id: int) -> np.ndarray:
    parts: list[np.ndarray] = []
    batch: list[str] = []

    def flush() -> None:
        if tokenizer_id == "bytes":  # the byte tokenizer's ids are the UTF-8 bytes: skip the BPE pass
            rows = [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in batch]
        else:
            rows = [np.asarray(r) for r in tokenizer(batch, add_special_tokens=False)["input_ids"]]
        for r in rows:
            parts.append(r.astype(np.int32))
            parts.append(np.array([eos_id], dtype=np.int32))
        batch.clear()

    for t in texts:
        batch.append(t)
        if len(batch) >= 1000:
            flush()
    if batch:
        flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


@dataclass
class TokenData:
    """Sequences of ``seq_len`` tokens: ``train`` [n_train, seq_len] and held-out ``eval`` [n_eval, seq_len]."""

    train: np.ndarray
    eval: np.ndarray
    tokens: int
    """Tokens in the stream (before cutting into sequences)."""
    cache_file: Path
    cache_hit: bool


def load_token_data(
    path: str | Path, tokenizer: Any, *, tokenizer_id: str, eos_id: int, seq_len: int, eval_fraction: float,
    text_field: str = "text", cache_dir: str | Path,
) -> TokenData:
    """Tokenise ``path`` (or read the cache), cut into sequences, split off the held-out part. Raises
    ``StartupError`` for data with fewer tokens than one sequence."""
    kind, paths = find_sources(path)
    key = _cache_key(kind, paths, tokenizer_id=tokenizer_id, seq_len=seq_len, text_field=text_field, eos_id=eos_id)
    cache = Path(cache_dir) / f"{key}.npy"
    hit = cache.is_file()
    if hit:
        seqs = np.load(cache, mmap_mode="r")
        tokens = int(json.loads(cache.with_suffix(".json").read_text())["tokens"])
    else:
        scratch = tempfile.mkdtemp(prefix="ds_wallfacer_data_")
        try:
            stream = _tokenize(_read_texts(kind, paths, text_field=text_field, scratch=scratch), tokenizer,
                               tokenizer_id=tokenizer_id, eos_id=eos_id)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        tokens = len(stream)
        n = tokens // seq_len
        seqs = stream[: n * seq_len].reshape(n, seq_len)
        if n:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_name(f".{cache.name}.{os.getpid()}.tmp.npy")
            np.save(tmp, seqs)
            meta = cache.with_suffix(".json")
            meta_tmp = meta.with_name(f".{meta.name}.{os.getpid()}.tmp")
            meta_tmp.write_text(json.dumps({"tokens": tokens, "sequences": n, "seq_len": seq_len, "source": str(path)}))
            os.replace(meta_tmp, meta)  # metadata first: a visible .npy always has its .json
            os.replace(tmp, cache)
    n = len(seqs)
    if n == 0:
        raise StartupError(f"--data {str(path)!r} has {tokens} tokens, fewer than one sequence of --seq_len {seq_len}: "
                           "add data or lower --seq_len")
    n_eval = 0 if eval_fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * eval_fraction)))
    return TokenData(train=seqs[: n - n_eval], eval=seqs[n - n_eval :], tokens=tokens, cache_file=cache, cache_hit=hit)


def document_lengths(row: np.ndarray, eos_id: int) -> list[int]:
    """A token row -> the lengths of its documents: each ends with (and includes) an EOS token; the tail after the
    last EOS is a document cut by the row end."""
    ends = (np.flatnonzero(np.asarray(row) == eos_id) + 1).tolist()
    bounds = [0, *[e for e in ends if e < len(row)], len(row)]
    return [b - a for a, b in zip(bounds, bounds[1:])]


class _Batches:
    """An iterable of full batches (``SequenceParallelLoader`` hands batch j to replica j % D); with ``eos_id``,
    each batch also carries ``document_lengths`` (documents end at EOS), so attention never crosses a document."""

    def __init__(self, rows: list[tuple[np.ndarray, np.ndarray | None]], *, eos_id: int | None = None,
                 order: np.ndarray | None = None) -> None:
        self._rows, self._eos = rows, eos_id
        self.order = order
        """The whole epoch's sequence indices in the order its rounds take them (from the epoch's start)."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for ids, labels in self._rows:
            if isinstance(ids, dict):  # conversations: a batch with its own labels, mask and images
                yield ids
                continue
            batch = {"input_ids": torch.from_numpy(np.array(ids, dtype=np.int64))}
            if labels is not None:
                batch["labels"] = torch.from_numpy(labels)
            if self._eos is not None:
                batch["document_lengths"] = [document_lengths(r, self._eos) for r in np.asarray(ids)]
            yield batch


def row_works(seqs: np.ndarray, eos_id: int) -> list[int]:
    """Every row's attention work under document masking (its documents' squares, ``data/steps.py``)."""
    return [row_work(document_lengths(r, eos_id)) for r in seqs]


def train_batches(
    seqs: np.ndarray, *, micro: int, dp: int, epoch: int, seed: int, start: int = 0, eos_id: int | None = None,
    work: Sequence[int] | None = None,
) -> _Batches:
    """Epoch ``epoch``'s global micro-batches from sequence ``start`` on (a multiple of ``micro * dp``); the
    epoch holds ``len(seqs) // (micro * dp)`` rounds of one micro-batch per replica. ``eos_id``: document masking.
    ``work`` (``row_works``): the epoch's shuffled rows are put in work-balanced rounds (``balanced_order``), the
    same order on every rank and on resume."""
    per_round = micro * dp
    if start % per_round:
        raise ValueError(f"data position {start} is not a multiple of micro batch x data-parallel size = {per_round}")
    perm = np.random.default_rng([seed, epoch]).permutation(len(seqs))
    end = len(seqs) // per_round * per_round
    if work is not None:
        order = balanced_order([work[i] for i in perm], per_replica=micro, replicas=dp, seed=seed * 1_000_003 + epoch)
        perm = perm[order]
    return _Batches([(seqs[perm[j : j + micro]], None) for j in range(start, end, micro)], eos_id=eos_id,
                    order=perm[:end])


def eval_batches(
    seqs: np.ndarray, *, micro: int, dp: int, eos_id: int | None = None
) -> tuple[_Batches, list[int]]:
    """Every held-out sequence once, in rounds of one micro-batch per replica (all ranks run the same number of
    forwards: ZeRO-3 gathers parameters over the whole world); missing rows repeat a sequence with every label
    ignored. Returns the batches and each batch's counted tokens (targets: seq_len - 1 per real row)."""
    if isinstance(seqs, ConversationRows):
        batches, targets = eval_rounds(seqs, micro=micro, dp=dp)
        return _Batches([(b, None) for b in batches]), targets
    per_round = micro * dp
    rounds = -(-len(seqs) // per_round)
    rows, counts = [], []
    for j in range(rounds * dp):
        idx = list(range(j * micro, (j + 1) * micro))
        ids = np.stack([seqs[min(i, len(seqs) - 1)] for i in idx]).astype(np.int64)
        labels = ids.copy()
        real = [i < len(seqs) for i in idx]
        labels[[not r for r in real]] = -100
        rows.append((ids, labels))
        if eos_id is None:
            counts.append(sum(real) * (seqs.shape[1] - 1))
        else:  # no target for each document's last token
            counts.append(sum(len(r) - len(document_lengths(r, eos_id)) for r, ok in zip(ids, real) if ok))
    return _Batches(rows, eos_id=eos_id), counts


def load_data(args: Any, loaded: Any, *, dynamic: bool) -> Any:
    """The trainer's data: ``load_token_data``, or a ``.jsonl`` of conversations (``conversations.py``) rendered by
    the model folder's processor, each a row (with whole-row options refused)."""
    if not is_conversation_file(args.data):
        return load_token_data(args.data, loaded.tokenizer, tokenizer_id=loaded.tokenizer_id, eos_id=loaded.eos_id,
                               seq_len=args.seq_len, eval_fraction=args.eval_fraction, text_field=args.text_field,
                               cache_dir=args.cache_dir or Path(args.output_dir) / "token_cache")
    for bad, what in ((args.document_masking, "--document_masking"),
                      (dynamic, "wallfacer.dynamic_sequence_parallel")):
        if bad:
            raise StartupError(f"--data {args.data!r} holds conversations, each trained as its own right-padded row: "
                               f"{what} does not apply to them; drop it")
    processor = load_processor(loaded.folder, model=args.model)
    return load_conversations(args.data, processor, seq_len=args.seq_len, eval_fraction=args.eval_fraction)


def token_rows(data: str, tokenizer: Any, *, tokenizer_id: str, eos_id: int, seq_len: int,
               cache_dir: Path) -> tuple[list[dict], list[dict]]:
    """Local text cut into rows of ``seq_len`` tokens (documents joined by EOS), 10 % held out: (train, eval)
    lists of ``{"input_ids", "labels"}`` for a Trainer's datasets."""
    tokens = load_token_data(data, tokenizer, tokenizer_id=tokenizer_id, eos_id=eos_id, seq_len=seq_len,
                             eval_fraction=0.1, cache_dir=cache_dir)

    def rows(seqs) -> list[dict]:
        return [{"input_ids": [int(t) for t in s], "labels": [int(t) for t in s]} for s in seqs]

    return rows(tokens.train), rows(tokens.eval)
