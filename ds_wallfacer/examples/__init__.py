"""The example ds_configs and the demo corpus, shipped inside the package so that the trainer's defaults work
from an installed wheel in any folder. In a checkout, ``ds_configs/`` and ``launch/data/`` are links to them.
Also the ds_config as the Trainer examples (``launch/train_hf.py``, ``launch/train_trl.py``) and their ALST
baseline want it (the Trainer's keys on "auto"). Pure: no torch.

The examples' shared parts, so that every script in ``launch/`` imports only from the package: ``hf.py`` (the
Trainer examples' options, arguments, model, data and summary), ``rl.py`` (the DPO and GRPO examples'), ``vlm.py``
(the tiny vision-language models and synthetic image conversations of ``launch/train_vlm.py``, the tests and the
sweep; it imports torch), ``vlm_chat.py`` (the image-conversation example in ``vlm_chat/``: tiny PNGs, a JSONL of
conversations, a tiny LLaVA and its processor)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_DIR", "DATA_DIR", "config_names", "find_config", "trainer_config"]

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


_TRAINER_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
                 "gradient_clipping")
"""What transformers' Trainer fills from its own arguments when the ds_config says "auto"."""


def trainer_config(name: str) -> dict[str, Any]:
    """A shipped example (by name) or a ds_config file, as transformers' Trainer wants it: the batch sizes,
    clipping and learning rate set to "auto", so the Trainer's arguments own them."""
    path = find_config(name) or Path(name)
    cfg = json.loads(Path(path).read_text())
    for key in _TRAINER_KEYS:
        cfg[key] = "auto"
    if "optimizer" in cfg:
        cfg["optimizer"].setdefault("params", {})["lr"] = "auto"
    return cfg
