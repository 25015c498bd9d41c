"""Gated delta-nets (Qwen3-Next: linear-attention layers with one fused projection, MoE; Qwen3.5: separate
projections, dense; OLMo-hybrid: one projection per tensor, beta doubled) through the real integration
(``initialize``, a DeepSpeed engine, 4 gloo ranks) against the same HF model in one process with its own torch
convolution and chunked scan: loss at every step and every parameter (the decay parameters and the convolution
included) after the SGD steps, fp32, clipping off. Each rank scans 1 of 4 key heads and 2 of 8 value heads. Packed
documents against each document run alone (transformers' torch scan ignores document boundaries). Every mode,
P = 1, MsT, balanced sharding, ZeRO 1/2/3. The training loop and the packed reference are test_packed.py's."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.integration.test_packed import _train
from tests.models import TINY_CONFIG

_LAYERS = ["linear_attention", "full_attention", "linear_attention"]


def tiny_delta_net(family: str = "qwen3_next") -> torch.nn.Module:
    """3 layers (linear, full, linear attention), hidden 64; linear attention: 4 key and 8 value heads of 8,
    convolution kernel 4; full attention: 4 / 2 heads of 16."""
    torch.manual_seed(0)
    kw = {k: TINY_CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "vocab_size", "max_position_embeddings")}
    kw.update(num_hidden_layers=len(_LAYERS), layer_types=_LAYERS, head_dim=16, linear_conv_kernel_dim=4,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4, linear_num_value_heads=8,
              attn_implementation="eager")
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


CASES = [  # (family, wallfacer section, ZeRO stage, packed documents)
    ("qwen3_next", {"mode": "wallfacer", "ring_count": 1}, 1, False),
    ("qwen3_next", {"mode": "wallfacer", "ring_count": 2}, 3, True),
    ("qwen3_5", {"mode": "ulysses"}, 2, True),
    ("qwen3_5", {"mode": "hybrid", "ulysses_degree": 2, "sharding": "balanced",
                 "mini_sequence": {"activation_checkpointing": "torch"}}, 3, True),
    ("qwen3_5", {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 1}, 1, True),
    ("olmo_hybrid", {"mode": "hybrid", "ulysses_degree": 2}, 1, True),
]


def _body(rank: int, world: int) -> list[str]:
    failures = []
    for family, wallfacer, stage, packed in CASES:
        failures += [f"{family}: {f}" for f in _train(lambda f=family: tiny_delta_net(f), wallfacer, stage=stage,
                                                     packed=packed)]
    return failures


def test_gated_delta_nets_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=900)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not failures, "\n".join(failures[:30])
