"""Peak bytes of the tensors a piece of code creates and holds at once (CPU), for checking the memory model.

``TensorPeak`` is a dispatch mode: every operator output whose storage is new (not one of its inputs' storages: views
and in-place results are not new memory) is counted until its storage is freed. Tensors that existed before (the
parameters, gradients that are accumulated into) are not counted.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorPeak"]


class TensorPeak(TorchDispatchMode):
    """``with TensorPeak() as t: ...``; then ``t.peak`` (bytes) and ``t.at_peak`` (operator name)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.at_peak = ""

    def _freed(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or key in inputs or storage.nbytes() == 0:
                continue
            self.live[key] = storage.nbytes()
            self.current += storage.nbytes()
            weakref.finalize(storage, self._freed, key)
            if self.current > self.peak:
                self.peak, self.at_peak = self.current, str(func)
        return out
