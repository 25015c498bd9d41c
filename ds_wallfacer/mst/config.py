"""Settings of the Mini-Sequence Transformer (docs/design/memory.md): the ``"wallfacer": {"mini_sequence": {...}}``
section of the ds_config JSON, parsed once into a frozen dataclass, and the rule that turns ``"auto"`` into sizes.

Sizes are given in TOKENS per mini-sequence (not as a count of mini-sequences): a token count is what bounds the
memory of one mini-sequence, whatever the sequence length. Tokens are counted over batch x sequence positions of the
local (per sequence-parallel rank) shard. Pure Python: no torch import, unit-tested without processes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Union

from .._sections import section_kwargs

__all__ = [
    "DEFAULT_LOGITS_BUDGET_MIB",
    "CHECKPOINTING_CHOICES",
    "MiniSequenceConfig",
    "ResolvedSizes",
    "resolve_sizes",
]

DEFAULT_LOGITS_BUDGET_MIB = 256
"""Default fp32-logits budget of one LM-head mini-sequence (``mini_sequence.lm_head_logits_budget_mib``)."""

CHECKPOINTING_CHOICES: tuple[str, ...] = ("deepspeed", "torch", "none")
Size = Union[int, Literal["auto"]]
_FP32_BYTES = 4
_MIB = 1024 * 1024


def _check_size(key: str, value: Any) -> None:
    if value == "auto":
        return
    # bool is an int subclass; True as a size is a mistake, not 1
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"wallfacer.mini_sequence.{key} = {value!r} is invalid: allowed is a positive integer number of "
            f'tokens per mini-sequence or "auto"'
        )


@dataclass(frozen=True)
class MiniSequenceConfig:
    """The ``"wallfacer": {"mini_sequence": {...}}`` section; every key optional, defaults below."""

    mlp: bool = True
    """Run each decoder layer's position-wise MLP in mini-sequences (custom autograd function, input-only saved)."""
    mlp_chunk_tokens: Size = "auto"
    """Tokens per MLP mini-sequence; "auto" = hidden_size / 4 tokens (``auto_mlp_chunk_tokens`` says why)."""
    lm_head: bool = True
    """Compute LM head + cross-entropy in mini-sequences, never materialising the full [S, V] logits."""
    lm_head_chunk_tokens: Size = "auto"
    """Tokens per LM-head mini-sequence; "auto" = largest count whose fp32 logits fit lm_head_logits_budget_mib."""
    lm_head_logits_budget_mib: int = DEFAULT_LOGITS_BUDGET_MIB
    """Budget (MiB) of one mini-sequence's fp32 logits for "auto"; the gradient is formed in the same buffer (2x
    with final-logit soft-capping)."""
    activation_checkpointing: Literal["deepspeed", "torch", "none"] = "deepspeed"
    """Decoder-layer checkpointing: DeepSpeed's (ds_config "activation_checkpointing" section, incl. CPU offload),
    torch's non-reentrant one, or none."""
    mlp_module_names: tuple[str, ...] | None = None
    """Force these decoder-layer child names as MLPs (checked position-wise, error if not); None = auto-detect."""
    offload_checkpoints: bool = False
    """With layer checkpointing: each layer input waits in host memory (pinned, copied on a side stream) from its
    layer's forward to its recompute in backward (``mst/offload.py``); the device holds one at a time."""
    norm: bool = True
    """Run the model's RMSNorms lean (``mst/norm.py``): in chunks of rows, saving only the input and one fp32
    factor per row instead of fp32 copies of the input and of the normalised rows."""
    keep_attention: bool = True
    """With layer checkpointing: keep attention's output and log-sum-exp (Ulysses: also what its all-to-alls
    received) at the first forward, so the layer recompute in backward runs no attention kernel and no attention
    communication (``attention/residuals.py``); costs about one layer input per layer (Ulysses about 3.5)."""

    def __post_init__(self) -> None:
        for key in ("mlp", "lm_head", "norm", "keep_attention", "offload_checkpoints"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(
                    f"wallfacer.mini_sequence.{key} = {getattr(self, key)!r} is invalid: allowed is true or false"
                )
        if self.offload_checkpoints and self.activation_checkpointing == "none":
            raise ValueError(
                'wallfacer.mini_sequence.offload_checkpoints = true needs layer checkpointing: set '
                'mini_sequence.activation_checkpointing to "torch" or "deepspeed"'
            )
        _check_size("mlp_chunk_tokens", self.mlp_chunk_tokens)
        _check_size("lm_head_chunk_tokens", self.lm_head_chunk_tokens)
        budget = self.lm_head_logits_budget_mib
        if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
            raise ValueError(
                f"wallfacer.mini_sequence.lm_head_logits_budget_mib = {budget!r} is invalid: allowed is a positive "
                f"integer number of MiB"
            )
        if self.activation_checkpointing not in CHECKPOINTING_CHOICES:
            raise ValueError(
                f"wallfacer.mini_sequence.activation_checkpointing = {self.activation_checkpointing!r} is invalid: "
                f"allowed are {', '.join(repr(c) for c in CHECKPOINTING_CHOICES)}"
            )
        names = self.mlp_module_names
        if names is not None and (
            not isinstance(names, tuple) or not names or not all(isinstance(n, str) and n for n in names)
        ):
            raise ValueError(
                f"wallfacer.mini_sequence.mlp_module_names = {names!r} is invalid: allowed is null or a non-empty "
                f"list of child-module names such as [\"mlp\"]"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "MiniSequenceConfig":
        """Parse and validate the ``mini_sequence`` sub-dict (None or {} gives the defaults)."""
        if d is None:
            return cls()
        kwargs = section_kwargs(cls, d, name="wallfacer.mini_sequence")
        if isinstance(kwargs.get("mlp_module_names"), list):
            kwargs["mlp_module_names"] = tuple(kwargs["mlp_module_names"])
        return cls(**kwargs)


@dataclass(frozen=True)
class ResolvedSizes:
    """Tokens per mini-sequence after "auto" is resolved for one (tokens, hidden, vocab) shape."""

    mlp_chunk_tokens: int
    """Tokens per MLP mini-sequence."""
    lm_head_chunk_tokens: int
    """Tokens per LM-head mini-sequence."""
    mlp_chunks: int
    """Number of MLP mini-sequences M = ceil(tokens / mlp_chunk_tokens) (>= 1; the last one may be shorter)."""
    lm_head_chunks: int
    """Number of LM-head mini-sequences (>= 1; the last one may be shorter)."""


def auto_mlp_chunk_tokens(hidden_size: int) -> int:
    """hidden_size / 4 tokens per MLP mini-sequence (docs/design/memory.md).

    MsT's and DeepSpeed TiledMLP's rule is hidden_size tokens (M = ceil(S / d)). A gradient-returning MLP backward
    (``mlp.py``) holds its weights' gradient sums, 3 * I * d for a gated MLP, beside one mini-sequence's recompute,
    about 6 * c * I (the saved intermediates and their gradients); TiledMLP writes into ``.grad`` instead and holds
    only the 6 * c * I. At c = d / 4 the recompute is half the sums and the whole (about 5.5 * I * d with the one
    fresh weight gradient) stays below TiledMLP's 6 * I * d, at the price of 4x as many, 4x smaller matrix products
    (16-bit weights: the sums are fp32, twice their size, and the whole stays above TiledMLP's).
    """
    return max(1, int(hidden_size) // 4)


def auto_lm_head_chunk_tokens(vocab_size: int, budget_mib: int) -> int:
    """Largest token count whose fp32 logits [tokens, vocab] fit ``budget_mib`` (at least 1 token)."""
    return max(1, (budget_mib * _MIB) // (_FP32_BYTES * int(vocab_size)))


def resolve_sizes(
    config: MiniSequenceConfig, *, tokens: int, hidden_size: int, vocab_size: int
) -> ResolvedSizes:
    """Turn "auto" into token counts for ``tokens`` local tokens (batch x sequence) of the given model shape."""
    if tokens < 0 or hidden_size <= 0 or vocab_size <= 0:
        raise ValueError(
            f"resolve_sizes needs tokens >= 0, hidden_size > 0, vocab_size > 0; got {tokens}, {hidden_size}, "
            f"{vocab_size}"
        )
    mlp = (
        auto_mlp_chunk_tokens(hidden_size) if config.mlp_chunk_tokens == "auto" else int(config.mlp_chunk_tokens)
    )
    head = (
        auto_lm_head_chunk_tokens(vocab_size, config.lm_head_logits_budget_mib)
        if config.lm_head_chunk_tokens == "auto"
        else int(config.lm_head_chunk_tokens)
    )
    return ResolvedSizes(
        mlp_chunk_tokens=mlp,
        lm_head_chunk_tokens=head,
        mlp_chunks=max(1, math.ceil(tokens / mlp)),
        lm_head_chunks=max(1, math.ceil(tokens / head)),
    )
