"""Tiny HF models that train differently from a dense Llama: mixture-of-experts with the router aux loss, every
RoPE type transformers ships, LM heads with logit scaling or soft-capping, gated delta-nets and LFM2's short
convolutions. Built from config (no downloads); the adapter tests here, tests/audit/ and tests/hf_trainer/ use them."""
from __future__ import annotations

import torch

from tests.models import TINY_CONFIG

__all__ = ["AUX_COEF", "HEAD_DIM", "MOE_FAMILIES", "tiny_delta_net", "tiny_head", "tiny_lfm2", "tiny_moe", "tiny_rope"]

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
    """Granite (``logits_scaling``, divided), HyperCLOVAX (``logits_scaling``, multiplied), Cohere (``logit_scale``) or Gemma-2 (``final_logit_softcapping``; attention
    soft-capping and sliding windows off: those have their own tests in tests/integration/test_packed.py)."""
    torch.manual_seed(seed)
    if family == "granite":
        from transformers import GraniteConfig, GraniteForCausalLM

        model = GraniteForCausalLM(GraniteConfig(**TINY_CONFIG, logits_scaling=4.0, **overrides))
    elif family == "hyperclovax":  # logits * logits_scaling, the attribute Granite divides by
        from transformers.models.hyperclovax.configuration_hyperclovax import HyperCLOVAXConfig
        from transformers.models.hyperclovax.modeling_hyperclovax import HyperCLOVAXForCausalLM

        model = HyperCLOVAXForCausalLM(HyperCLOVAXConfig(**TINY_CONFIG, logits_scaling=0.5, **overrides))
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


_DELTA_NET_LAYERS = ["linear_attention", "full_attention", "linear_attention"]


def tiny_delta_net(family: str = "qwen3_next") -> torch.nn.Module:
    """3 layers (linear, full, linear attention), hidden 64; linear attention: 4 key and 8 value heads of 8,
    convolution kernel 4; full attention: 4 / 2 heads of 16."""
    torch.manual_seed(0)
    kw = {k: TINY_CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "vocab_size", "max_position_embeddings")}
    kw.update(num_hidden_layers=len(_DELTA_NET_LAYERS), layer_types=_DELTA_NET_LAYERS, head_dim=16,
              linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
              linear_num_value_heads=8, attn_implementation="eager")
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        return Qwen3NextForCausalLM(Qwen3NextConfig(**kw, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=32,
                                                    shared_expert_intermediate_size=32)).train()
    if family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**kw)).train()
    if family == "olmo_hybrid":  # separate projections, beta doubled (negative eigenvalues allowed)
        from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

        return OlmoHybridForCausalLM(OlmoHybridConfig(**kw, linear_allow_neg_eigval=True, pad_token_id=0,
                                                      eos_token_id=2)).train()
    raise ValueError(family)


_LFM2_LAYERS = ["conv", "full_attention", "conv", "conv"]


def tiny_lfm2(family: str = "lfm2") -> torch.nn.Module:
    """4 layers (conv, attention, conv, conv), hidden 64, 4 / 2 heads, convolution kernel 3 with bias."""
    torch.manual_seed(0)
    kw = {k: TINY_CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "vocab_size", "max_position_embeddings")}
    kw.update(num_hidden_layers=len(_LFM2_LAYERS), layer_types=_LFM2_LAYERS, conv_L_cache=3, conv_bias=True,
              attn_implementation="eager")
    if family == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        return Lfm2ForCausalLM(Lfm2Config(**kw)).train()
    if family == "lfm2_moe":
        from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

        return Lfm2MoeForCausalLM(Lfm2MoeConfig(**kw, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                                                moe_intermediate_size=32)).train()
    raise ValueError(family)
