"""Mini-Sequence Transformer (MsT, arXiv 2407.15892; docs/design/memory.md).

Position-wise blocks run over mini-sequences of the (local) sequence so no full-length intermediate is held:

- ``apply_mini_sequence(model, config, *, ds_config=None) -> MiniSequenceHandle``: wraps each decoder layer's MLP
  (input-only saved, recomputed per mini-sequence in backward), marks the LM head for the chunked loss, and turns
  on decoder-layer activation checkpointing (DeepSpeed's or torch's). Call before ``deepspeed.initialize``.
- ``mini_sequence_causal_lm_loss(model, hidden_states, labels, *, chunk_tokens=None, ignore_index=-100)
  -> (loss_sum, token_count)`` on already-shifted labels; never materialises full logits.
- ``mini_sequence_lm_loss(model, *, labels=None | shift_labels=None, ..., **backbone_kwargs) -> token-mean loss``.
- ``lean_rms_norm`` / ``norm_form``: transformers' RMSNorms in chunks of rows, saving only their input and one fp32
  factor per row (``apply_mini_sequence`` installs it on every recognised norm).
- ``MiniSequenceConfig`` (``"wallfacer": {"mini_sequence": {...}}``) and ``resolve_sizes`` for "auto".
"""
from .._lazy import lazy_exports

_EXPORTS = {
    "MiniSequenceHandle": ".apply",
    "apply_mini_sequence": ".apply",
    "find_decoder_layers": ".apply",
    "CHECKPOINTING_CHOICES": ".config",
    "MiniSequenceConfig": ".config",
    "ResolvedSizes": ".config",
    "resolve_sizes": ".config",
    "chunked_linear_cross_entropy": ".lm_head",
    "mini_sequence_causal_lm_loss": ".lm_head",
    "mini_sequence_lm_loss": ".lm_head",
    "MiniSequenceMLPFunction": ".mlp",
    "check_position_wise": ".mlp",
    "mini_sequence_mlp": ".mlp",
    "lean_rms_norm": ".norm",
    "norm_form": ".norm",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
