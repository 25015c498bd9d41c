"""LFM2 (gated short convolutions of kernel 3 between attention layers) and LFM2-MoE through the real integration
(``initialize``, a DeepSpeed engine, 4 gloo ranks) against the same HF model in one process: loss at every step and
every parameter (the convolutions' included) after the SGD steps, fp32, clipping off. Packed documents against each
document run alone (transformers' torch convolution ignores document boundaries, so a packed row through the model
itself would let documents leak into each other). Every mode, P = 1, MsT, balanced sharding, ZeRO 1/2/3. The training
loop and the packed reference are tests/integration/reference_run.py's."""
from __future__ import annotations

from functools import partial

from tests.adapters.models import tiny_lfm2
from tests.dist_utils import run_distributed
from tests.integration.reference_run import train_like_reference

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
        run = train_like_reference(partial(tiny_lfm2, family), wallfacer, stage=stage, packed=packed)
        failures += [f"{family}: {f}" for f in run]
    return failures


def test_short_convolutions_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=900)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not failures, "\n".join(failures[:30])
