"""Block-kernel calls counted by phase: every kernel the attention modules choose after ``count_kernels()`` (in this
process) counts its forward and backward calls into one Counter."""
from __future__ import annotations

from collections import Counter
from typing import Any

__all__ = ["count_kernels"]


class _Counting:
    """A block kernel that counts its forward and backward calls."""

    def __init__(self, kernel: Any, counts: Counter) -> None:
        self._kernel, self._counts = kernel, counts

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kernel, name)

    def forward(self, *a: Any, **kw: Any) -> Any:
        self._counts["forward"] += 1
        return self._kernel.forward(*a, **kw)

    def backward(self, *a: Any, **kw: Any) -> Any:
        self._counts["backward"] += 1
        return self._kernel.backward(*a, **kw)


def count_kernels() -> Counter:
    """Patch the kernel choice of WallFacer and local attention (process-wide; tests run in spawned ranks) so that
    every kernel chosen from now on counts into the returned Counter."""
    from ds_wallfacer.attention import local, wallfacer

    counts: Counter = Counter()
    for mod in (local, wallfacer):
        orig = mod.get_kernel
        mod.get_kernel = lambda *a, _orig=orig, **kw: _Counting(_orig(*a, **kw), counts)
    return counts
