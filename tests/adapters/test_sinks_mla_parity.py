"""gpt-oss (per-head attention sinks, alternating sliding-window layers) and DeepSeek-V3 (multi-head latent attention:
value heads narrower than query/key heads) through the real integration (``initialize``, a DeepSpeed engine, 4 gloo
ranks) against the same HF model in one process with its own eager attention: loss at every step and every parameter
(the sinks included) after the SGD steps, fp32, clipping off; packed documents against each document run alone. The
training loop and the packed reference are tests/integration/reference_run.py's."""
from __future__ import annotations

from functools import partial

import torch

from tests.dist_utils import run_distributed
from tests.integration.reference_run import train_like_reference
from tests.models import TINY_CONFIG

_SMALL = {k: TINY_CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size",
                                      "max_position_embeddings")}


def tiny_attention_model(family: str) -> torch.nn.Module:
    """gpt-oss: 4 / 2 heads of 16 with sinks, layers (window 12, full), 4 experts; DeepSeek-V3: MLA with q/k heads
    of 8 + 8 (nope + rope) and value heads of 8, low-rank q and kv, a dense layer then an MoE layer."""
    torch.manual_seed(0)
    if family == "gpt_oss":
        from transformers import GptOssConfig, GptOssForCausalLM

        cfg = GptOssConfig(**_SMALL, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12,
                           layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                           num_experts_per_tok=2, attn_implementation="eager")
        return GptOssForCausalLM(cfg).train()
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg = DeepseekV3Config(**_SMALL, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                               qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                               moe_intermediate_size=32, attn_implementation="eager")
        return DeepseekV3ForCausalLM(cfg).train()
    raise ValueError(family)


# (family, wallfacer section, ZeRO stage, packed documents)
CASES = [  # multi-ring (C = 2) and Ulysses alone: tests/attention/test_sinks_value_dim.py
    ("gpt_oss", {"mode": "wallfacer", "ring_count": 1}, 3, True),
    ("gpt_oss", {"mode": "hybrid", "ulysses_degree": 2, "mini_sequence": {"activation_checkpointing": "torch"}}, 2,
     True),  # attention kept from the first forward for the layer recompute (attention/residuals.py)
    ("deepseek_v3", {"mode": "wallfacer", "ring_count": 1}, 1, True),
    ("deepseek_v3", {"mode": "hybrid", "ulysses_degree": 2}, 3, False),
]


def _body(rank: int, world: int) -> list[str]:
    failures = []
    for family, wallfacer, stage, packed in CASES:
        run = train_like_reference(partial(tiny_attention_model, family), wallfacer, stage=stage, packed=packed)
        failures += [f"{family}: {f}" for f in run]
    return failures


def test_sinks_and_latent_attention_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=600)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not failures, "\n".join(failures[:30])
