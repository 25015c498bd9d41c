"""Attention runs once per step under layer activation checkpointing (the DistFlashAttn idea, arXiv 2310.03294).

``KeepAttention`` wraps a checkpoint function (``keep_attention_in_layers`` does so for every checkpointed layer of a
model): attention's first forward keeps what its backward needs, and the layer's recompute in backward gets it back
without kernels or communication. ``kept_bytes_per_layer`` gives the bytes kept per layer, ``ResidualStats`` what
is really held.

Design: Note [Attention once under layer checkpointing] in docs/design/memory.md (how a first forward, its recompute
and an ordinary forward are told apart; what each op keeps, and for how long).
"""
from __future__ import annotations

import contextvars
import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .volume import kept_bytes_per_layer

__all__ = [
    "CheckpointFrame",
    "KeepAttention",
    "ResidualStats",
    "Slot",
    "keep_attention",
    "keep_attention_in_layers",
    "kept_bytes_per_layer",
    "residual_slot",
    "residual_stats",
    "tensor_key",
]

log = logging.getLogger("ds_wallfacer")

_FRAME: contextvars.ContextVar["CheckpointFrame | None"] = contextvars.ContextVar(
    "ds_wallfacer_checkpoint_frame", default=None
)
"""The frame of the checkpointed call running now in this thread (dynamic scope, like torch's grad mode): set
only while a ``CheckpointFrame`` runs its layer function."""


@dataclass
class ResidualStats:
    """Counts of one ``KeepAttention`` (all its frames), for tests and benchmarks."""

    stored: int = 0
    """Attention ops whose residuals a first forward kept."""
    replayed: int = 0
    """Ops a recompute answered from their entry (no kernel, no communication)."""
    missed: int = 0
    """Ops in a recompute with no usable entry (released, mismatched, or never stored): computed for real."""
    released: int = 0
    """Entries dropped: after their backward, on a mismatch, or with their frame."""
    kept_bytes: int = 0
    """Bytes held by entries now."""
    peak_bytes: int = 0
    """Most bytes held at once since the last ``reset``."""
    warned: bool = field(default=False, repr=False)
    """A mismatch has been logged (once per ``KeepAttention``)."""

    def reset(self) -> None:
        self.stored = self.replayed = self.missed = self.released = 0
        self.peak_bytes = self.kept_bytes

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("stored", "replayed", "missed", "released", "kept_bytes", "peak_bytes")}


@dataclass(eq=False)
class _Entry:
    key: tuple
    tensors: tuple[torch.Tensor, ...]
    nbytes: int
    backward_done: bool = False


class CheckpointFrame:
    """One checkpointed call of a layer function: its first run keeps attention residuals, later runs (recomputes)
    replay them."""

    def __init__(self, stats: ResidualStats, *, keep: bool) -> None:
        self.stats = stats
        self.keep = keep
        """Whether a recompute can follow (grad was enabled at the checkpointed call); else nothing is kept."""
        self.runs = 0
        self.entries: list[_Entry | None] = []
        self._cursor = 0
        self._trusted = True

    def __del__(self) -> None:
        # the graph holding this frame is gone (its backward ran, or never will): what is left no longer counts
        for i in range(len(self.entries)):
            self._drop(i)

    def call(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        """Run the layer function once (the first forward, or a recompute) with this frame current."""
        self.runs += 1
        self._cursor, self._trusted = 0, True
        token = _FRAME.set(self)
        try:
            return function(*args, **kwargs)
        finally:
            _FRAME.reset(token)

    def bind(self, function: Callable) -> Callable:
        """``function`` run through ``call``: what the checkpoint implementation gets."""
        return functools.partial(self.call, function)

    # -- slots ------------------------------------------------------------------------------------
    def _slot(self, key: tuple) -> "Slot | None":
        index = self._cursor
        self._cursor += 1
        if self.runs == 1:
            if not self.keep:
                return None
            self.entries.append(None)
            return Slot(self, index, key, False)
        entry = self.entries[index] if index < len(self.entries) else None
        if entry is not None and self._trusted and entry.key == key:
            self.stats.replayed += 1
            return Slot(self, index, key, True)
        if entry is not None or index >= len(self.entries):
            if self._trusted and not self.stats.warned:
                self.stats.warned = True
                _warn_mismatch(entry, key)
            # call order no longer matches the first forward: nothing from here on can be replayed, now or later
            self._trusted = False
            for i in range(index, len(self.entries)):
                self._drop(i)
        self.stats.missed += 1
        return None

    def _store(self, index: int, key: tuple, tensors: tuple[torch.Tensor, ...]) -> None:
        kept = tuple(t.detach() for t in tensors)
        nbytes = sum(t.numel() * t.element_size() for t in kept)
        self.entries[index] = _Entry(key, kept, nbytes)
        s = self.stats
        s.stored += 1
        s.kept_bytes += nbytes
        s.peak_bytes = max(s.peak_bytes, s.kept_bytes)

    def _drop(self, index: int) -> None:
        entry = self.entries[index]
        if entry is None:
            return
        self.entries[index] = None
        self.stats.released += 1
        self.stats.kept_bytes -= entry.nbytes

    def _backward_done(self, index: int) -> None:
        entry = self.entries[index] if index < len(self.entries) else None
        if entry is None:
            return
        if self.runs > 1:
            self._drop(index)
        else:  # torch's non-reentrant checkpoint: a node that saved nothing ran before the recompute; keep for it
            entry.backward_done = True


def _warn_mismatch(entry: _Entry | None, key: tuple) -> None:
    what = ("an attention call its first forward did not make" if entry is None
            else "a different attention call from its first forward")
    log.warning("ds_wallfacer: a checkpointed layer's recompute made %s (%s); attention is computed again for the "
                "rest of that recompute (correct, but not free)", what, key[0])


@dataclass(eq=False)
class Slot:
    """One attention op's place in a frame: in a first forward compute, then ``keep``; in a recompute
    (``replaying``) ``take`` the kept tensors and compute nothing."""

    frame: CheckpointFrame
    index: int
    key: tuple
    replaying: bool

    def take(self) -> tuple[torch.Tensor, ...]:
        """The kept tensors, as new tensor objects (autograd gives them the replaying node as grad_fn). Nothing here
        keeps them: a slot referenced by its node's ctx must not reference that node's output, or the cycle
        tensor -> grad_fn -> ctx -> slot -> tensor would hold each recomputed graph until the garbage collector
        runs (measured: +3 q/k/v-sized tensors per layer at the backward peak)."""
        entry = self.frame.entries[self.index]
        assert self.replaying and entry is not None, "take() outside a replay"
        tensors = tuple(t.detach() for t in entry.tensors)
        if entry.backward_done:  # torch: its backward already ran, this replay was the last use
            self.frame._drop(self.index)
        return tensors

    def keep(self, *tensors: torch.Tensor) -> None:
        """Keep what the recompute will return and what backward needs (first forward only)."""
        if not self.replaying:
            self.frame._store(self.index, self.key, tensors)

    def done(self) -> None:
        """The op's backward has run: its entry is no longer needed (call from the backward that used it)."""
        self.frame._backward_done(self.index)


def tensor_key(*tensors: torch.Tensor) -> tuple:
    """What a kept result depends on besides values: shapes, dtypes and devices (values are the same by
    construction: the frame is one checkpointed call, recomputed from its own saved inputs)."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


def residual_slot(kind: str, *key: Any) -> Slot | None:
    """The slot of the attention op being called now. None outside a checkpointed layer, when nothing will be
    recomputed, or when a recompute has no usable entry: compute as usual. Else compute and ``keep`` (a first
    forward), or ``take`` the kept result (``replaying``). ``kind`` names the op (in messages); ``key`` is
    everything its result depends on besides input values (compared with ==; tuples compare items by identity
    first)."""
    frame = _FRAME.get()
    if frame is None:
        return None
    return frame._slot((kind, *key))


@dataclass(eq=False)
class KeepAttention:
    """A layer checkpoint function that keeps attention's residuals across the recompute.

    ``KeepAttention(inner)(function, *args, **kwargs)`` is ``inner(function, *args, **kwargs)`` with ``function``
    run inside one ``CheckpointFrame`` per call; ``inner`` is any checkpoint function that calls ``function`` once
    in forward and again to recompute (``torch.utils.checkpoint.checkpoint`` reentrant or not,
    ``deepspeed.checkpointing.checkpoint``). Install it where HF installs its checkpoint function
    (``model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=KeepAttention(...))``)."""

    inner: Callable
    stats: ResidualStats = field(default_factory=ResidualStats)

    def frame(self) -> CheckpointFrame:
        """A new frame for one checkpointed call (grad mode now decides whether a recompute can follow)."""
        return CheckpointFrame(self.stats, keep=torch.is_grad_enabled())

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return self.inner(self.frame().bind(function), *args, **kwargs)


def keep_attention(checkpoint_fn: Callable) -> KeepAttention:
    """``checkpoint_fn`` wrapped in ``KeepAttention`` (returned as is when it already is one)."""
    return checkpoint_fn if isinstance(checkpoint_fn, KeepAttention) else KeepAttention(checkpoint_fn)


def keep_attention_in_layers(model: torch.nn.Module) -> int:
    """Wrap the checkpoint function of every checkpointed HF layer of ``model`` (installed by
    ``gradient_checkpointing_enable`` or ``_set_gradient_checkpointing``) in ``KeepAttention``, one wrapper per
    distinct function; layers already wrapped are left as they are. Returns the number of checkpointed layers."""
    wrapped: dict[int, KeepAttention] = {}
    n = 0
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if fn is None or not getattr(m, "gradient_checkpointing", False):
            continue
        n += 1
        if not isinstance(fn, KeepAttention):
            if id(fn) not in wrapped:
                wrapped[id(fn)] = KeepAttention(fn)
            m._gradient_checkpointing_func = wrapped[id(fn)]
    return n


def residual_stats(model: torch.nn.Module) -> ResidualStats:
    """The summed counts of every residual-keeping checkpoint function installed on ``model``'s layers (zeros when
    none is)."""
    total, seen = ResidualStats(), set()
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        stats = getattr(fn, "stats", None)
        if isinstance(stats, ResidualStats) and id(stats) not in seen:
            seen.add(id(stats))
            for k, v in stats.as_dict().items():
                setattr(total, k, getattr(total, k) + v)
    return total
