"""Model descriptions for the topology planner: the shape facts the cost and memory model need.

Read from an HF config (object or dict) or taken from the presets. Assumes a Llama-style decoder: grouped-query
attention with q/k/v/o projections, a gated (SwiGLU) MLP of three matrices, RMSNorm, untied or tied LM head.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["ModelSpec", "MODELS", "get_model"]


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only LM."""

    name: str
    layers: int
    hidden: int
    heads: int
    """Query heads."""
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0
    """Head dim of queries and keys; 0: hidden // heads."""
    value_head_dim: int = 0
    """Head dim of values and the attention output; 0: ``head_dim`` (multi-head latent attention's differs)."""
    tied_embeddings: bool = False
    mlp_matrices: int = 3
    """3 for gated MLPs (gate, up, down), 2 for plain ones."""

    def __post_init__(self) -> None:
        for key in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {key}={value!r} must be a positive integer")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.head_dim == 0:
            if self.hidden % self.heads:
                raise ValueError(f"model {self.name!r}: hidden={self.hidden} not divisible by heads={self.heads}; "
                                 "give head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.value_head_dim == 0:
            object.__setattr__(self, "value_head_dim", self.head_dim)

    # -- parameter counts ------------------------------------------------------------------------
    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer (projections, MLP, two norms)."""
        h, d, dv = self.hidden, self.head_dim, self.value_head_dim
        attn = h * self.heads * (d + dv) + h * self.kv_heads * (d + dv)  # q and o; k and v
        return attn + self.mlp_matrices * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        """All parameters: embedding, layers, final norm, LM head (unless tied)."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied_embeddings else 2) + self.layers * self.layer_params + self.hidden

    def layer_matmul_flops(self, tokens: int) -> float:
        """Forward matmul FLOPs of one layer's projections and MLP over ``tokens`` tokens."""
        return 2.0 * tokens * (self.layer_params - 2 * self.hidden)

    @classmethod
    def from_hf_config(cls, config: Any, *, name: str | None = None) -> "ModelSpec":
        """From a ``transformers`` config object or its ``to_dict()``; text sub-configs are followed."""
        get = config.get if isinstance(config, Mapping) else (lambda k, default=None: getattr(config, k, default))
        text = get("text_config")
        if text is not None and get("num_hidden_layers") is None:
            return cls.from_hf_config(text, name=name)
        missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if get(k) is None]
        if missing:
            raise ValueError(f"HF config lacks {missing}: not a decoder LM config the planner understands")
        heads = int(get("num_attention_heads"))
        hidden = int(get("hidden_size"))
        qk = get("qk_head_dim") or (int(get("qk_nope_head_dim")) + int(get("qk_rope_head_dim") or 0)
                                    if get("qk_nope_head_dim") is not None else None)  # MLA: nope + rope
        head_dim = int(qk or get("head_dim") or hidden // heads)
        return cls(
            name=name or str(get("_name_or_path") or get("model_type") or "hf-model"),
            layers=int(get("num_hidden_layers")),
            hidden=hidden,
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            intermediate=int(get("intermediate_size") or 4 * hidden),
            vocab=int(get("vocab_size")),
            head_dim=head_dim,
            value_head_dim=int(get("v_head_dim") or head_dim),
            tied_embeddings=bool(get("tie_word_embeddings", False)),
        )


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256),
        ModelSpec("llama2-7b", layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=11008, vocab=32000),
        # the paper's worked example: LLaMA-1 30B shape (hidden 6656, 52 heads, multi-head attention)
        ModelSpec("llama-30b-like", layers=60, hidden=6656, heads=52, kv_heads=52, intermediate=17920, vocab=32000),
        ModelSpec("qwen2-7b", layers=28, hidden=3584, heads=28, kv_heads=4, intermediate=18944, vocab=152064),
    )
}


def get_model(model: str | ModelSpec | Mapping[str, Any] | Any) -> ModelSpec:
    """A preset by name, a ``ModelSpec``, or anything ``from_hf_config`` reads."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        try:
            return MODELS[model]
        except KeyError:
            raise ValueError(f"unknown model preset {model!r}; presets are {sorted(MODELS)}") from None
    return ModelSpec.from_hf_config(model)
