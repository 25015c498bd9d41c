"""transformers ``Trainer`` scripts with sequence parallelism: replace ``Trainer`` by ``WallfacerTrainer`` (TRL's
``SFTTrainer``, ``DPOTrainer``, ``KTOTrainer``, ``GRPOTrainer`` and ``RLOOTrainer`` by the ``Wallfacer...``
trainer of the same name) and add a ``"wallfacer"`` section to the ds_config the script passes as
``TrainingArguments(deepspeed=...)``. Needs accelerate, as transformers' Trainer does, and trl for the TRL trainers
(``pip install ds_wallfacer[hf]``)."""
from typing import Any

from .options import UnsupportedTrainerOption
from .trainer import WallfacerTrainer, WallfacerTrainerMixin

__all__ = ["UnsupportedTrainerOption", "WallfacerDPOTrainer", "WallfacerGRPOTrainer", "WallfacerKTOTrainer",
           "WallfacerRLOOTrainer", "WallfacerSFTTrainer", "WallfacerTrainer", "WallfacerTrainerMixin"]

_TRL = {"WallfacerSFTTrainer": "sft", "WallfacerDPOTrainer": "preference", "WallfacerGRPOTrainer": "rl",
        "WallfacerRLOOTrainer": "rl", "WallfacerKTOTrainer": "preference"}
"""The TRL trainers, imported (with trl) only when asked for."""


def __getattr__(name: str) -> Any:
    if name in _TRL:
        import importlib

        return getattr(importlib.import_module(f".{_TRL[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
