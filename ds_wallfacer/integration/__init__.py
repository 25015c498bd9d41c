"""HF transformers + DeepSpeed integration: ``attn_implementation="wallfacer"`` (WallFacer, Ulysses or
the hybrid, chosen by the ds_config ``"wallfacer"`` section), the entry point around ``deepspeed.initialize``,
the global token-mean loss. Importing this package registers the attention function with transformers."""
from ..adapters.hf import ATTN_IMPLEMENTATION, attach, attention_modules, detach, register, wallfacer_attention_forward
from ..adapters.moe import RouterAuxLoss, router_aux_loss
from ..audit import ModelAudit, audit_model
from .deepspeed import SequenceParallel, initialize, model_heads
from .loss import LocalLoss, SequenceParallelCausalLM, global_token_mean, logits_loss, mini_sequence_loss
from .parallel import SequenceParallelGroups, build_sequence_parallel, check_same_batch

register()

__all__ = [
    "ATTN_IMPLEMENTATION",
    "LocalLoss",
    "ModelAudit",
    "RouterAuxLoss",
    "SequenceParallel",
    "SequenceParallelCausalLM",
    "SequenceParallelGroups",
    "attach",
    "attention_modules",
    "audit_model",
    "build_sequence_parallel",
    "check_same_batch",
    "detach",
    "global_token_mean",
    "initialize",
    "logits_loss",
    "mini_sequence_loss",
    "model_heads",
    "register",
    "router_aux_loss",
    "wallfacer_attention_forward",
]
