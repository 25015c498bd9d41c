"""MsT inside a real DeepSpeed engine: ZeRO 1, 2, 3 on 2 gloo CPU ranks, every parameter's full gradient and the
SGD update compared with the unmodified HF model (fp32, no gradient clipping: clipping hides constant factors).

One process launch runs all stages and cases (start-up dominates on 2 cores).
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from tests.dist_utils import run_distributed

from .models import batch, hf_loss, tiny_model

LR = 0.5
# (family, activation_checkpointing, seq_len, mlp_chunk_tokens, lm_head_chunk_tokens, gradient_accumulation_steps)
CASES = [
    ("llama", "deepspeed", 29, 8, 5, 1),
    ("qwen2", "none", 3, 8, 16, 2),
    ("mistral", "torch", 21, 4, 6, 1),
]


class _LossModel(nn.Module):
    """What a training loop hands to deepspeed.initialize: forward returns the token-mean loss."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from ds_wallfacer.mst import mini_sequence_lm_loss

        return mini_sequence_lm_loss(self.lm, labels=labels, input_ids=input_ids)


def _ds_config(stage: int, gas: int) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3:
        # tiny parameters would otherwise stay unpartitioned ("persistent") and ZeRO-3 would not be exercised
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0, stage3_prefetch_bucket_size=0)
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 0,
        "zero_allow_untested_optimizer": True,  # plain SGD: the update is exactly p - lr * grad
        "zero_optimization": zero,
        "activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": True},
        "wall_clock_breakdown": False,
    }


def _engine_case(rank: int, world: int, stage: int, case: tuple) -> list[str]:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from ds_wallfacer.mst import apply_mini_sequence

    kind, ckpt, seq_len, mlp_chunk, head_chunk, gas = case
    ref = tiny_model(kind)
    ours = copy.deepcopy(ref)
    # micro-batch m of rank r: every rank computes the reference over all ranks' data
    data = {
        (r, m): batch(seq_len, seed=100 * r + m, pad_from=seq_len - 3 if seq_len > 6 else None)
        for r in range(world)
        for m in range(gas)
    }
    # DeepSpeed averages micro-batch means over ranks and accumulation steps
    for (ids, labels) in data.values():
        (hf_loss(ref, ids, labels) / (world * gas)).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref_after = {n: p.detach() - LR * p.grad for n, p in ref.named_parameters()}

    ds_config = _ds_config(stage, gas)
    handle = apply_mini_sequence(
        ours,
        {"mlp_chunk_tokens": mlp_chunk, "lm_head_chunk_tokens": head_chunk, "activation_checkpointing": ckpt},
        ds_config=ds_config,
    )
    assert len(handle.mlp_modules) == 2, handle
    mlp_tokens = [0]  # tokens through the MLPs' last projection: 2 runs per token (test_recompute.py)

    def count(_mod: nn.Module, inputs: tuple, _out: torch.Tensor) -> None:
        mlp_tokens[0] += inputs[0].shape[:-1].numel()

    for layer in ours.model.layers:
        layer.mlp.down_proj.register_forward_hook(count)
    wrapped = _LossModel(ours)
    engine, *_ = deepspeed.initialize(
        model=wrapped, optimizer=torch.optim.SGD(wrapped.parameters(), lr=LR), config=ds_config
    )
    if stage == 3:  # really partitioned, and each MLP gathered as one ZeRO-3 leaf
        assert all(p.numel() == 0 for p in engine.module.lm.model.layers[0].mlp.parameters())
        assert engine.module.lm.model.layers[0].mlp._z3_leaf
    for m in range(gas):
        ids, labels = data[(rank, m)]
        loss = engine(ids, labels)
        engine.backward(loss)
        if m + 1 < gas:
            engine.step()  # not a boundary: DeepSpeed only accumulates
    failures = []
    runs = mlp_tokens[0] / (seq_len * gas * len(ours.model.layers))
    if runs != 2:
        failures.append(f"MLP forward ran {runs} times per token, expected 2")
    for name, p in engine.module.named_parameters():
        key = name.removeprefix("lm.")
        g = safe_get_full_grad(p)
        if g is None or not torch.allclose(g, ref_grads[key], rtol=1e-4, atol=1e-6):
            err = None if g is None else (g - ref_grads[key]).abs().max().item()
            failures.append(f"grad {key}: max err {err}")
    engine.step()
    for name, p in engine.module.named_parameters():
        key = name.removeprefix("lm.")
        w = safe_get_full_fp32_param(p)
        if not torch.allclose(w, ref_after[key], rtol=1e-4, atol=1e-6):
            failures.append(f"param after step {key}: max err {(w - ref_after[key]).abs().max().item()}")
    engine.destroy()
    return [f"stage {stage} {case}: {f}" for f in failures]


def _all_cases(rank: int, world: int) -> list[str]:
    failures = []
    for stage in (1, 2, 3):
        for case in CASES:
            failures += _engine_case(rank, world, stage, case)
    return failures


def test_zero_stages_match_hf() -> None:
    results = run_distributed(_all_cases, 2, timeout_s=400)
    failures = [f for rank_failures in results for f in rank_failures]
    assert not failures, "\n".join(failures[:40])
