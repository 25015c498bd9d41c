"""The example ds_configs and the demo corpus, shipped inside the package so that the trainer's defaults work
from an installed wheel in any folder. In a checkout, ``ds_configs/`` and ``launch/data/`` are links to them.
Pure: no torch."""
from __future__ import annotations

from pathlib import Path

__all__ = ["CONFIG_DIR", "DATA_DIR", "config_names", "find_config"]

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""The example ds_configs (``<name>.json``; which is which: README.md)."""
DATA_DIR = Path(__file__).resolve().parent / "data"
"""The demo corpus: a few KB of public-domain text (``data/README.md``)."""


def config_names() -> list[str]:
    """The shipped examples' names, without ``.json``."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def find_config(name: str) -> Path | None:
    """The shipped example called ``name`` (``"hybrid"`` or ``"hybrid.json"``), or None. A name with a folder in it
    is a path, never an example."""
    if not name or Path(name).name != name:
        return None
    path = CONFIG_DIR / (name if name.endswith(".json") else f"{name}.json")
    return path if path.is_file() else None
