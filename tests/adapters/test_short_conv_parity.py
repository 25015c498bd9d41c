"""LFM2 (gated short convolutions of kernel 3 between attention layers) and LFM2-MoE through the real integration
(``initialize``, a DeepSpeed engine, 4 gloo ranks) against the same HF model in one process: loss at every step and
every parameter (the convolutions' included) after the SGD steps, fp32, clipping off. Packed documents against each
document run alone (transformers' torch convolution ignores document boundaries, so a packed row through the model
itself would let documents leak into each other). Every mode, P = 1, MsT, balanced sharding, ZeRO 1/2/3. The
training loop and the packed reference are test_packed.py's."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.integration.test_packed import _train
from tests.models import TINY_CONFIG

_LAYERS = ["conv", "full_attention", "conv", "conv"]


def tiny_lfm2(family: str = "lfm2") -> torch.nn.Module:
    """4 layers (conv, attention, conv, conv), hidden 64, 4 / 2 heads, convolution kernel 3 with bias."""
    torch.manual_seed(0)
    kw = {k: TINY_CONFIG[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                      "num_key_value_heads", "vocab_size", "max_position_embeddings")}
    kw.update(num_hidden_layers=len(_LAYERS), layer_types=_LAYERS, conv_L_cache=3, conv_bias=True,
              attn_implementation="eager")
    if family == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        return Lfm2ForCausalLM(Lfm2Config(**kw)).train()
    if family == "lfm2_moe":
        from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

        return Lfm2MoeForCausalLM(Lfm2MoeConfig(**kw, num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                                                moe_intermediate_size=32)).train()
    raise ValueError(family)


CASES = [  # (family, wallfacer section, ZeRO stage, packed documents)
    ("lfm2", {"mode": "wallfacer", "ring_count": 1}, 1, False),
    ("lfm2", {"mode": "wallfacer", "ring_count": 2}, 2, True),
    ("lfm2", {"mode": "ulysses"}, 3, True),
    ("lfm2", {"mode": "hybrid", "ulysses_degree": 2, "sharding": "balanced",
              "mini_sequence": {"activation_checkpointing": "torch"}}, 2, True),
    ("lfm2", {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 1}, 1, True),
    ("lfm2_moe", {"mode": "wallfacer", "ring_count": 1, "sharding": "contiguous"}, 3, True),
]


def _body(rank: int, world: int) -> list[str]:
    failures = []
    for family, wallfacer, stage, packed in CASES:
        failures += [f"{family}: {f}" for f in _train(lambda f=family: tiny_lfm2(f), wallfacer, stage=stage,
                                                     packed=packed)]
    return failures


def test_short_convolutions_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=900)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not failures, "\n".join(failures[:30])
