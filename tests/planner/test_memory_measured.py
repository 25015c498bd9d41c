"""The planner's memory model against a measured step: the peak bytes of the tensors one forward + backward of a real
DeepSpeed engine creates (``TensorPeak``) equal the model's ``activations`` within 10 %, on one CPU rank, for a
Llama-shaped model (8 query / 2 kv heads, MLP 3.5x) at several lengths, in fp32 and bf16, with the runtime's settings
the planner chooses between: layer checkpointing keeping attention's results or recomputing them, no checkpointing,
a mini-sequence as long as the sequence; and with 8 kv heads and small LM-head chunks, where the peak is attention's
backward, under DeepSpeed's (reentrant) and torch's checkpointing."""
from __future__ import annotations

from tests.dist_utils import run_distributed

TOLERANCE = 0.10
HIDDEN, INTERMEDIATE, VOCAB, LAYERS = 128, 448, 512, 2
# (tokens, dtype, mini_sequence section)
_CHUNK = {"mlp_chunk_tokens": 512}  # fewer operator calls than "auto" (32 tokens at this width): a faster test
_ATTENTION_PEAK = {**_CHUNK, "lm_head_logits_budget_mib": 1}  # with 8 kv heads the peak is attention's backward
# (tokens, dtype, kv heads, mini_sequence section)
CASES = [
    (2048, "fp32", 2, _CHUNK),
    (4096, "bf16", 2, _CHUNK),
    (2048, "bf16", 2, {**_CHUNK, "keep_attention": False}),
    (2048, "fp32", 2, {**_CHUNK, "activation_checkpointing": "none"}),
    (2048, "bf16", 2, {"mlp_chunk_tokens": 2048}),
    (2048, "bf16", 8, _ATTENTION_PEAK),
    (2048, "bf16", 8, {**_ATTENTION_PEAK, "activation_checkpointing": "torch"}),
]


def _measure(rank: int, world: int) -> list[tuple[str, float, float]]:
    import torch

    from ds_wallfacer.integration import initialize
    from ds_wallfacer.mst.config import MiniSequenceConfig, resolve_sizes
    from ds_wallfacer.planner import Candidate, ModelSpec, Workload, get_cluster, memory_breakdown
    from tests.models import tiny_model

    from .tensor_peak import TensorPeak

    out = []
    for tokens, dtype, kv_heads, ms in CASES:
        model = tiny_model("llama", hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, vocab_size=VOCAB,
                           num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=kv_heads,
                           max_position_embeddings=tokens)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 0},
                  "zero_allow_untested_optimizer": True,
                  "wallfacer": {"mode": "wallfacer", "ring_count": 1, "mini_sequence": ms}}
        if dtype == "bf16":
            model, config["bf16"] = model.to(torch.bfloat16), {"enabled": True}
        engine, sp = initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        ids = torch.randint(1, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(0))
        batch = sp.shard({"input_ids": ids, "labels": ids.clone()})

        def forward_backward() -> None:
            engine.backward(engine(**batch))

        forward_backward()  # gradients exist from here on: the measured step accumulates into them
        with TensorPeak() as peak:
            forward_backward()
        engine.destroy()

        msc = MiniSequenceConfig.from_dict(ms)
        sizes = resolve_sizes(msc, tokens=tokens, hidden_size=HIDDEN, vocab_size=VOCAB)
        cand = Candidate(sp_size=1, mini_sequence=True, mlp_chunk_tokens=sizes.mlp_chunk_tokens,
                         lm_head_chunk_tokens=sizes.lm_head_chunk_tokens,
                         checkpointing=msc.activation_checkpointing != "none", keep_attention=msc.keep_attention,
                         reentrant=msc.activation_checkpointing == "deepspeed")
        spec = ModelSpec.from_hf_config(model.config)
        workload = Workload(seq_len=tokens, elem_bytes=2 if dtype == "bf16" else 4, zero_stage=0)
        predicted = memory_breakdown(spec, get_cluster("cpu").with_world_size(1), cand, workload).activations
        out.append((f"{tokens} {dtype} kv {kv_heads} {ms}", float(peak.peak), float(predicted)))
    return out


def test_memory_model_predicts_the_measured_peak() -> None:
    rows = run_distributed(_measure, 1, timeout_s=900)[0]
    for name, m, p in rows:
        print(f"{name}: measured {m / 2**20:.2f} MiB, predicted {p / 2**20:.2f} MiB ({p / m - 1:+.1%})")
    bad = [f"{name}: measured {m / 2**20:.2f} MiB, predicted {p / 2**20:.2f} MiB ({p / m - 1:+.1%})"
           for name, m, p in rows if abs(p / m - 1) > TOLERANCE]
    assert not bad, "\n".join(bad)
