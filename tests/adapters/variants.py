"""Tiny HF models that train differently from a dense Llama: mixture-of-experts with the router aux loss, every
RoPE type transformers ships, LM heads with logit scaling or soft-capping. Built from config (no downloads)."""
from __future__ import annotations

import torch

from tests.models import TINY_CONFIG

# a large coefficient so that a missing or wrong aux loss moves the router far beyond the tolerances
AUX_COEF = 0.5
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
HEAD_DIM = 16  # hidden 64 / 4 heads


def tiny_moe(family: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """2 layers, 4 experts, top-2, ``output_router_logits=True``; Qwen2-MoE's layer 1 is a dense MLP."""
    torch.manual_seed(seed)
    moe = dict(output_router_logits=True, router_aux_loss_coef=AUX_COEF, num_experts_per_tok=2)
    if family == "mixtral":
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(**TINY_CONFIG, **moe, num_local_experts=4, sliding_window=None)
        model = MixtralForCausalLM(cfg)
    elif family == "qwen2_moe":
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        cfg = Qwen2MoeConfig(**TINY_CONFIG, **moe, num_experts=4, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64, mlp_only_layers=[1])
        model = Qwen2MoeForCausalLM(cfg)
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(**TINY_CONFIG, **moe, num_experts=4, moe_intermediate_size=32, head_dim=HEAD_DIM)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        raise ValueError(family)
    for k, v in overrides.items():
        setattr(model.config, k, v)
    return model.train()


def _rope(rope_type: str) -> tuple[dict, int]:
    """(rope_parameters, max_position_embeddings) with scaling ACTIVE at 24..32 tokens."""
    half = HEAD_DIM // 2
    base = {"rope_theta": 10000.0, "rope_type": rope_type}
    if rope_type == "default":
        return base, 256
    if rope_type == "linear":
        return {**base, "factor": 2.0}, 256
    if rope_type == "dynamic":  # NTK base grows once seq_len > max_position_embeddings
        return {**base, "factor": 2.0}, 16
    if rope_type == "yarn":
        return {**base, "factor": 4.0, "original_max_position_embeddings": 16}, 64
    if rope_type == "longrope":  # long factors once seq_len > original_max_position_embeddings
        short = [1.0 + 0.05 * i for i in range(half)]
        long = [1.5 + 0.5 * i for i in range(half)]
        return {**base, "short_factor": short, "long_factor": long, "original_max_position_embeddings": 16}, 32
    if rope_type == "llama3":
        return {**base, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}, 256
    if rope_type == "proportional":
        return {**base, "partial_rotary_factor": 0.5}, 256
    raise ValueError(rope_type)


def tiny_rope(rope_type: str, *, family: str = "llama", seed: int = 0) -> torch.nn.Module:
    """A tiny Llama (or Phi-3) with the given ``rope_type``."""
    torch.manual_seed(seed)
    params, max_pos = _rope(rope_type)
    common = {**TINY_CONFIG, "max_position_embeddings": max_pos}
    if family == "phi3":
        from transformers import Phi3Config, Phi3ForCausalLM

        model = Phi3ForCausalLM(Phi3Config(**common, rope_parameters=params, pad_token_id=0))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=params))
    return model.train()


def tiny_head(family: str, *, seed: int = 0, **overrides) -> torch.nn.Module:
    """Granite (``logits_scaling``), Cohere (``logit_scale``) or Gemma-2 (``final_logit_softcapping``; attention
    soft-capping and sliding windows off: those have their own tests in test_packed.py)."""
    torch.manual_seed(seed)
    if family == "granite":
        from transformers import GraniteConfig, GraniteForCausalLM

        model = GraniteForCausalLM(GraniteConfig(**TINY_CONFIG, logits_scaling=4.0, **overrides))
    elif family == "cohere":
        from transformers import CohereConfig, CohereForCausalLM

        model = CohereForCausalLM(CohereConfig(**TINY_CONFIG, logit_scale=0.25, **overrides))
    elif family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        # a window longer than any test sequence: full attention
        cfg = dict(attn_logit_softcapping=None, sliding_window=4096, final_logit_softcapping=3.0, head_dim=HEAD_DIM)
        cfg.update(overrides)
        model = Gemma2ForCausalLM(Gemma2Config(**{**TINY_CONFIG, "attn_implementation": "eager"}, **cfg))
    else:
        raise ValueError(family)
    return model.train()
