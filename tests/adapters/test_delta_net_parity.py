"""Gated delta-nets (Qwen3-Next: linear-attention layers with one fused projection, MoE; Qwen3.5: separate projections,
dense; OLMo-hybrid: one projection per tensor, beta doubled) through the real integration (``initialize``, a
DeepSpeed engine, 4 gloo ranks) against the same HF model in one process with its own torch convolution and chunked
scan: loss at every step and every parameter (the decay parameters and the convolution included) after the SGD steps,
fp32, clipping off. Each rank scans 1 of 4 key heads and 2 of 8 value heads. Packed documents against each document
run alone (transformers' torch scan ignores document boundaries). Every mode, P = 1, MsT, balanced sharding, ZeRO
1/2/3. The training loop and the packed reference are tests/integration/reference_run.py's."""
from __future__ import annotations

from functools import partial

from tests.adapters.models import tiny_delta_net
from tests.dist_utils import run_distributed
from tests.integration.reference_run import train_like_reference

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
        run = train_like_reference(partial(tiny_delta_net, family), wallfacer, stage=stage, packed=packed)
        failures += [f"{family}: {f}" for f in run]
    return failures


def test_gated_delta_nets_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=900)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not failures, "\n".join(failures[:30])
