"""Lazy package exports (PEP 562), so that importing a pure module never imports torch.

``from ds_wallfacer.comm.layout import RankLayout`` runs ``ds_wallfacer/comm/__init__.py`` first; if that imported
the collectives eagerly, every pure module (layout, world layout, planner, byte formulas, configs) would pull in
torch. Each package's ``__init__`` instead names where its exports live and imports them on first access.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(``__getattr__``, ``__dir__``) for ``package`` whose public name ``n`` lives in submodule
    ``exports[n]`` (relative, e.g. ``".ops"``)."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(exports[name], package), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
