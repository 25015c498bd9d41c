"""Llama 4's text model (chunked attention on its RoPE layers, temperature-tuned queries on its NoPE layer, MoE) through
the real integration (``initialize``, a DeepSpeed engine, 4 gloo ranks) against the same HF model in one process with
its own eager attention and masks: loss at every step and every parameter after the SGD steps, fp32, clipping off;
packed documents against each document run alone. 64 tokens in chunks of 16 (so most query/key pairs are masked),
``floor_scale`` 4 (so the query scale changes every 4 positions: HF's default 8192 would leave it at 1 for any test
length). The training loop and the packed reference are tests/integration/reference_run.py's."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.integration.reference_run import train_like_reference
from tests.models import TINY_CONFIG


def tiny_llama4() -> torch.nn.Module:
    """4 layers: 3 chunked with RoPE, 1 full without (temperature tuning); 4 / 2 heads of 16; 4 experts."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    torch.manual_seed(0)
    cfg = Llama4TextConfig(
        hidden_size=TINY_CONFIG["hidden_size"], intermediate_size=32, intermediate_size_mlp=TINY_CONFIG[
            "intermediate_size"], num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=TINY_CONFIG["vocab_size"], max_position_embeddings=TINY_CONFIG["max_position_embeddings"],
        attention_chunk_size=16, floor_scale=4, num_local_experts=4, attn_implementation="eager")
    return Llama4ForCausalLM(cfg).train()


CASES = [  # (wallfacer section, ZeRO stage, packed documents)
    ({"mode": "wallfacer", "ring_count": 1}, 1, False),
    ({"mode": "wallfacer", "ring_count": 2}, 2, True),
    ({"mode": "ulysses"}, 3, True),
    ({"mode": "hybrid", "ulysses_degree": 2}, 2, False),
]


def _body(rank: int, world: int) -> list[str]:
    failures = []
    for wallfacer, stage, packed in CASES:
        failures += train_like_reference(tiny_llama4, wallfacer, stage=stage, packed=packed)
    return failures


def test_chunked_attention_and_position_scaled_queries_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=600)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res]
    assert not failures, "\n".join(failures[:30])


def test_documents_are_cut_into_chunks_from_their_own_start() -> None:
    from ds_wallfacer.attention.documents import BatchDocuments
    from ds_wallfacer.adapters.positional import chunked_documents

    docs = BatchDocuments(starts=((0, 5, 40), (0,)), seq_len=64)
    assert chunked_documents(docs, 16).starts == ((0, 5, 21, 37, 40, 56), (0, 16, 32, 48))
