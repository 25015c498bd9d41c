"""Mamba-2 mixers (Granite 4 hybrid: Mamba-2 layers around an attention layer, MoE; Mamba-2 alone, no attention;
Falcon-H1: attention and Mamba-2 side by side in every layer, muP multipliers, one group read by all 4 ranks, with
and without the gated norm) through the real integration (``initialize``, a DeepSpeed engine, 4 gloo ranks) against
the same HF model in one process with its own torch convolution and chunked scan: loss at every step and every
parameter (A, D, dt bias and the convolution included) after the SGD steps, fp32, clipping off. Scan chunks of 16
tokens, so a sequence of 64 crosses several; 8 heads over 4 ranks, with 4 groups (one per rank) or 2 (each read by
two ranks). Packed documents against each document run alone. Every mode, P = 1, MsT, balanced sharding, ZeRO 1/2/3.
The training loop and the packed reference are tests/integration/reference_run.py's."""
from __future__ import annotations

from functools import partial

import torch

from tests.dist_utils import run_distributed
from tests.integration.reference_run import train_like_reference
from tests.models import TINY_CONFIG


def tiny_mamba(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    t = TINY_CONFIG
    if family == "granite_hybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        cfg = GraniteMoeHybridConfig(
            hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_attention_heads=4,
            num_key_value_heads=2, vocab_size=t["vocab_size"], max_position_embeddings=t["max_position_embeddings"],
            num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=32, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=4,
            mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, mamba_conv_bias=True,
            attn_implementation="eager")
        return GraniteMoeHybridForCausalLM(cfg).train()
    if family.startswith("falcon_h1"):  # muP multipliers that are not 1, so leaving one out fails
        from transformers import FalconH1Config, FalconH1ForCausalLM

        cfg = FalconH1Config(
            hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_attention_heads=4,
            num_key_value_heads=2, vocab_size=t["vocab_size"], max_position_embeddings=t["max_position_embeddings"],
            num_hidden_layers=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
            mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, mamba_rms_norm=family.endswith("norm"),
            ssm_in_multiplier=0.5, ssm_multipliers=[0.5, 2.0, 1.5, 0.7, 1.3], attn_implementation="eager")
        return FalconH1ForCausalLM(cfg).train()
    if family == "mamba2":
        from transformers import Mamba2Config, Mamba2ForCausalLM

        cfg = Mamba2Config(hidden_size=t["hidden_size"], vocab_size=t["vocab_size"], num_hidden_layers=2,
                           num_heads=8, head_dim=16, expand=2, n_groups=2, state_size=16, conv_kernel=4,
                           chunk_size=16)
        return Mamba2ForCausalLM(cfg).train()
    raise ValueError(family)


CASES = [  # (family, wallfacer section, ZeRO stage, packed documents)
    ("granite_hybrid", {"mode": "wallfacer", "ring_count": 1}, 1, False),
    ("granite_hybrid", {"mode": "wallfacer", "ring_count": 2}, 3, True),
    ("granite_hybrid", {"mode": "hybrid", "ulysses_degree": 2, "sharding": "balanced",
                        "mini_sequence": {"activation_checkpointing": "torch"}}, 2, True),
    ("mamba2", {"mode": "ulysses"}, 3, True),
    ("mamba2", {"mode": "wallfacer", "ring_count": 1, "sharding": "contiguous"}, 2, False),
    ("mamba2", {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 1}, 1, True),
    ("falcon_h1_norm", {"mode": "hybrid", "ulysses_degree": 2}, 3, True),
    ("falcon_h1", {"mode": "wallfacer", "ring_count": 2}, 1, True),
]


def _body(rank: int, world: int) -> list[str]:
    failures = []
    for family, wallfacer, stage, packed in CASES:
        run = train_like_reference(partial(tiny_mamba, family), wallfacer, stage=stage, packed=packed)
        failures += [f"{family}: {f}" for f in run]
    return failures


def test_mamba2_mixers_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=900)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not failures, "\n".join(failures[:30])
