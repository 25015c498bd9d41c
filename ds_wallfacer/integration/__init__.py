"""HF transformers + DeepSpeed integration: ``attn_implementation="wallfacer"`` (WallFacer, Ulysses or
the hybrid, chosen by the ds_config ``"wallfacer"`` section), the entry point around ``deepspeed.initialize``,
the global token-mean loss. Importing this package registers the attention function with transformers.

The pieces below the entry point live where they belong: the attention interface and the adapters in
``ds_wallfacer.adapters`` (``adapters.hf.attach``), the start-up audit in ``ds_wallfacer.audit``, the process
groups in ``integration.parallel`` (``build_sequence_parallel``, ``check_same_batch``)."""
from ..adapters.hf import ATTN_IMPLEMENTATION, register
from .deepspeed import initialize, prepare_sequence_parallel
from .loss import LocalLoss, SequenceParallelCausalLM, global_token_mean, logits_loss, mini_sequence_loss
from .sequence_parallel import SequenceParallel

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LocalLoss",
    "SequenceParallel",
    "SequenceParallelCausalLM",
    "global_token_mean",
    "initialize",
    "logits_loss",
    "mini_sequence_loss",
    "prepare_sequence_parallel",
    "register",
]
