"""Mini-Sequence Transformer (MsT, arXiv 2407.15892; DESIGN.md section 4; issue 3).

Position-wise blocks run over mini-sequences of the (local) sequence so no full-length intermediate is held:

- ``apply_mini_sequence(model, config, *, ds_config=None) -> MiniSequenceHandle``: wraps each decoder layer's MLP
  (input-only saved, recomputed per mini-sequence in backward), marks the LM head for the chunked loss, and turns
  on decoder-layer activation checkpointing (DeepSpeed's or torch's). Call before ``deepspeed.initialize``.
- ``mini_sequence_causal_lm_loss(model, hidden_states, labels, *, chunk_tokens=None, ignore_index=-100)
  -> (loss_sum, token_count)`` on already-shifted labels; never materialises full logits.
- ``mini_sequence_lm_loss(model, *, labels=None | shift_labels=None, ..., **backbone_kwargs) -> token-mean loss``.
- ``MiniSequenceConfig`` (``"wallfacer": {"mini_sequence": {...}}``) and ``resolve_sizes`` for "auto".
"""
from .apply import MiniSequenceHandle, apply_mini_sequence, find_decoder_layers
from .config import CHECKPOINTING_CHOICES, MiniSequenceConfig, ResolvedSizes, resolve_sizes
from .lm_head import chunked_linear_cross_entropy, mini_sequence_causal_lm_loss, mini_sequence_lm_loss
from .mlp import MiniSequenceMLPFunction, check_position_wise, mini_sequence_mlp

__all__ = [
    "CHECKPOINTING_CHOICES",
    "MiniSequenceConfig",
    "MiniSequenceHandle",
    "MiniSequenceMLPFunction",
    "ResolvedSizes",
    "apply_mini_sequence",
    "check_position_wise",
    "chunked_linear_cross_entropy",
    "find_decoder_layers",
    "mini_sequence_causal_lm_loss",
    "mini_sequence_lm_loss",
    "mini_sequence_mlp",
    "resolve_sizes",
]
