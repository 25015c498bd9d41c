"""Packed documents, sliding windows and attention soft-capping through the real integration (``initialize``, a
DeepSpeed engine, 4 gloo ranks), against non-parallel runs of the same HF model:

- windows and soft-capping (Mistral, Gemma-2 with alternating local/global layers and capped logits, Gemma-3
  text): the model's own eager attention on the full sequence;
- packed documents: the model run on each document SEPARATELY (the loss is the sum of every document's token
  losses over the total token count), in every mode, with balanced sharding, with MsT, and ZeRO-1 and ZeRO-3;
- bidirectional spans (Gemma 3 text, alternating local and global layers, the hybrid): the model's own attention
  with the masks transformers builds for Gemma 3's image tokens, spans longer than the window and across ranks;
- bad input: position ids that disagree with the documents on one rank fail on every rank at the first step.

Loss at step 0 and every parameter after ``STEPS`` SGD steps (clipping off)."""
from __future__ import annotations

import torch

from tests.dist_utils import run_distributed
from tests.integration.parity import parity_config
from tests.integration.reference_run import LR, SEQ, train_like_reference
from tests.models import TINY_CONFIG

_TORCH_CKPT = {"activation_checkpointing": "torch"}


def _windowed(family: str) -> torch.nn.Module:
    """Tiny models whose attention the package used to refuse: windows shorter than SEQ, capped logits."""
    torch.manual_seed(0)
    kw = {**TINY_CONFIG, "attn_implementation": "eager"}
    if family == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        return MistralForCausalLM(MistralConfig(**kw, sliding_window=12)).train()
    if family == "gemma2":
        from transformers import Gemma2Config, Gemma2ForCausalLM

        return Gemma2ForCausalLM(Gemma2Config(**kw, head_dim=16, sliding_window=12, attn_logit_softcapping=2.0,
                                              final_logit_softcapping=5.0, query_pre_attn_scalar=4)).train()
    if family == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(Gemma3TextConfig(**kw, head_dim=16, sliding_window=10,
                                                  layer_types=["sliding_attention", "full_attention"])).train()
    raise ValueError(family)


WINDOWED = [
    ("mistral", {"mode": "wallfacer", "ring_count": 1}),
    ("mistral", {"mode": "hybrid", "ulysses_degree": 2}),
    ("gemma2", {"mode": "wallfacer", "ring_count": 2}),
    ("gemma2", {"mode": "ulysses", "mini_sequence": _TORCH_CKPT}),
    ("gemma3", {"mode": "wallfacer", "ring_count": 1, "sharding": "contiguous"}),
]


PACKED = [
    ({"mode": "wallfacer", "ring_count": 1}, 1),
    ({"mode": "wallfacer", "ring_count": 2}, 3),
    ({"mode": "wallfacer", "ring_count": 1, "sharding": "balanced"}, 1),
    ({"mode": "ulysses", "mini_sequence": _TORCH_CKPT}, 3),
    ({"mode": "hybrid", "ulysses_degree": 2, "sharding": "balanced", "mini_sequence": {}}, 1),
]


def _bad_positions(rank: int) -> str | None:
    from ds_wallfacer.integration import initialize
    from tests.integration.models import tiny_model

    model = tiny_model("llama")
    engine, sp = initialize(model=model, config=parity_config(stage=1, wallfacer={"mode": "wallfacer"}),
                            optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    batch = sp.shard({"input_ids": torch.randint(1, 256, (1, SEQ)), "document_lengths": [[20, 44]]})
    if rank == 2:
        batch["position_ids"] = batch["position_ids"] + 1  # positions that are not those inside the documents
    try:
        engine(**batch)
        return None
    except ValueError as err:
        return str(err)
    finally:
        engine.destroy()


def _body(rank: int, world: int) -> dict:
    failures = []
    for family, wallfacer in WINDOWED:
        failures += [f"{family}: {f}" for f in train_like_reference(lambda f=family: _windowed(f), wallfacer,
                                                                    packed=False)]
    from tests.integration.models import tiny_model

    for wallfacer, stage in PACKED:
        failures += train_like_reference(lambda: tiny_model("llama"), wallfacer, stage=stage, packed=True)
    spans = lambda step: [(step, step + 5), (10, 27 + step), (40, 52)]  # noqa: E731  window 10; chunks of 8
    failures += [f"gemma3 spans: {f}" for f in train_like_reference(lambda: _windowed("gemma3"), {
        "mode": "hybrid", "ulysses_degree": 2}, packed=False, spans=spans)]
    return {"failures": failures, "bad": _bad_positions(rank)}


def test_windows_softcap_and_packed_documents_train_like_the_reference() -> None:
    results = run_distributed(_body, 4, timeout_s=900)
    failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["failures"]]
    assert not failures, "\n".join(failures[:30])
    for r, res in enumerate(results):
        assert res["bad"] is not None and "position ids on sequence-parallel rank(s) [2]" in res["bad"], (r, res["bad"])
