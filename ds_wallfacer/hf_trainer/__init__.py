"""transformers ``Trainer`` scripts with sequence parallelism: replace ``Trainer`` by ``WallfacerTrainer`` (TRL's
``SFTTrainer`` by ``WallfacerSFTTrainer``) and add a ``"wallfacer"`` section to the ds_config the script passes as
``TrainingArguments(deepspeed=...)``. Needs accelerate, as transformers' Trainer does, and trl for the SFT trainer
(``pip install ds_wallfacer[hf]``)."""
from typing import Any

from .options import UnsupportedTrainerOption
from .trainer import WallfacerTrainer, WallfacerTrainerMixin

__all__ = ["UnsupportedTrainerOption", "WallfacerSFTTrainer", "WallfacerTrainer", "WallfacerTrainerMixin"]


def __getattr__(name: str) -> Any:
    if name == "WallfacerSFTTrainer":  # imports trl only when asked for
        from .sft import WallfacerSFTTrainer

        return WallfacerSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
