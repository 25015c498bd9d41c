"""The one rule for reading a JSON section into a config dataclass: it must be an object, and every key must be
one of the dataclass's fields (an unknown key is a typo the user wants to hear about, not a silent default)."""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

__all__ = ["section_kwargs"]


def section_kwargs(cls: type, d: Any, *, name: str) -> dict[str, Any]:
    """``d`` as keyword arguments for dataclass ``cls``; ``name`` is the section's path in the ds_config, e.g.
    ``wallfacer.mini_sequence``. Raises ValueError naming the section and the valid keys."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{name} must be a JSON object, got {type(d).__name__}: {d!r}")
    allowed = [f.name for f in fields(cls)]
    unknown = sorted(set(d) - set(allowed))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; valid keys are {allowed}")
    return dict(d)
