"""What a user reads from a training run: the trainer's lines, not the deprecation notices that the packages we run
on raise about each other (DeepSpeed calling torch's renamed collectives, say). Those are the packages' business and
change with every release; ``WALLFACER_WARNINGS=all`` shows them. A notice raised from ds_wallfacer's own code still
shows: calling an old API is our bug."""
from __future__ import annotations

import os
import warnings

__all__ = ["THIRD_PARTY", "quiet_third_party_deprecations"]

THIRD_PARTY = r"(torch|deepspeed|transformers|accelerate|peft|trl|wandb|datasets|huggingface_hub)(\..*)?$"
"""The modules whose own deprecation notices are hidden (a notice is attributed to the module that made the call)."""


def quiet_third_party_deprecations() -> None:
    """Ignore FutureWarning and DeprecationWarning raised from third-party code, unless ``WALLFACER_WARNINGS=all``."""
    if os.environ.get("WALLFACER_WARNINGS") == "all":
        return
    for category in (FutureWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=THIRD_PARTY)
