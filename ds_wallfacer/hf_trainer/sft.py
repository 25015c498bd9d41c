"""``WallfacerSFTTrainer``: TRL's ``SFTTrainer`` with sequence parallelism, the same one-line change as
``WallfacerTrainer`` (``SFTTrainer(...)`` -> ``WallfacerSFTTrainer(...)``, a ``"wallfacer"`` section in the
ds_config of ``SFTConfig(deepspeed=...)``).

TRL prepares the data as usual (chat template, ``assistant_only_loss`` / ``completion_only_loss`` labels,
``packing`` into padding-free rows whose ``position_ids`` restart at every conversation); the mixin's loader then
shards each collated batch, reads the conversations from ``position_ids`` and trains them as separate documents.
The loss is the mixin's global token mean: TRL's ``nll``. What TRL computes only inside its own ``compute_loss``
(the fused LM head, entropy and token-accuracy metrics, the ``dft`` loss) is not used; ``loss_type="dft"`` is
refused (``options.refuse_unsupported``). Needs ``trl`` (``pip install ds_wallfacer[hf]``).
"""
from __future__ import annotations

from trl import SFTTrainer

from .trainer import WallfacerTrainerMixin

__all__ = ["WallfacerSFTTrainer"]


class WallfacerSFTTrainer(WallfacerTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""
