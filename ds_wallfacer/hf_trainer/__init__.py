"""transformers ``Trainer`` scripts with sequence parallelism: replace ``Trainer`` by ``WallfacerTrainer`` and add a
``"wallfacer"`` section to the ds_config the script passes as ``TrainingArguments(deepspeed=...)``. Needs
accelerate (``pip install ds_wallfacer[hf]``), as transformers' Trainer does."""
from .options import UnsupportedTrainerOption
from .trainer import WallfacerTrainer, WallfacerTrainerMixin

__all__ = ["UnsupportedTrainerOption", "WallfacerTrainer", "WallfacerTrainerMixin"]
