"""Parity with the non-parallel run: real DeepSpeed engines (ZeRO 1, 2, 3) on gloo CPU ranks, tiny Llama / Qwen2 /
Mistral from config, every sequence-parallel mode. Step-0 losses and every parameter after 3 SGD steps must match
the unmodified HF model trained on the full batches in one process (fp32, no gradient clipping: clipping and
Adam hide constant gradient factors, docs/design/layouts.md).

The matrix covers each mode x each ZeRO stage, each family, GQA with split and replicated kv heads, padding,
batch > 1, gradient accumulation, data parallelism beside sequence parallelism and MsT, in three launches.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed

from .models import full_batch, hf_loss, tiny_model
from .parity import Case, finish, first_step_failures, parity_config, run_cases, train

LR = 0.5
STEPS = 3


def _ds_config(case: Case) -> dict:
    return parity_config(stage=case.stage, wallfacer=case.wallfacer, micro_batch=case.batch_size,
                         gradient_accumulation_steps=case.gas, **case.extra)


def _reference(case: Case, dp: int) -> tuple[dict, dict]:
    """Non-parallel run: DeepSpeed's semantics = mean over replicas and micro-steps of each batch's token mean."""
    ref = tiny_model(case.family)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = {}
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(case.gas):
            for d in range(dp):
                batch = full_batch(case.seq_len, batch_size=case.batch_size, seed=(step * 10 + m) * 10 + d, pad=case.pad)
                loss = hf_loss(ref, batch)
                losses[(step, m, d)] = loss.item()
                (loss / (dp * case.gas)).backward()
        opt.step()
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _run_case(rank: int, world: int, case: Case) -> list[str]:
    from ds_wallfacer.integration import initialize

    ours = tiny_model(case.family)
    engine, sp = initialize(model=ours, config=_ds_config(case), optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    dp, d = sp.setup.dims.dp_size, sp.groups.dp_index
    assert sp.setup.dims.sp_size == case.wallfacer.get("sequence_parallel_size", world)
    if "mini_sequence" in case.wallfacer:  # MsT really in the path: both MLPs chunked, LM head wrapped
        assert sp.mini_sequence is not None and len(sp.mini_sequence.mlp_modules) == 2, sp.mini_sequence
    ref_losses, ref_params = _reference(case, dp)
    keys = [(step, m, d) for step in range(STEPS) for m in range(case.gas)]
    batches = (full_batch(case.seq_len, batch_size=case.batch_size, seed=(step * 10 + m) * 10 + d, pad=case.pad)
               for step, m, d in keys)
    failures = train(engine, sp, batches,
                     lambda i, loss: first_step_failures(loss.item(), ref_losses[keys[i]]) if keys[i][0] == 0 else [])
    # every collective tensor went through the comm layer's device check (comm/ops.py), on the engine's device
    assert sp.comm.device == torch.device(engine.device), (sp.comm.device, engine.device)
    assert sp.comm.checked >= sum(sp.comm.calls.values()) and (sp.comm.checked > 0 or sp.setup.dims.sp_size == 1)
    return finish(engine, ref_params, failures, steps=STEPS, name=case.name(), rank=rank)


WF, UL = "wallfacer", "ulysses"
# 4 ranks (P = 4): every mode x every stage, every family; ulysses U = 4 > 2 kv heads replicates them
CASES_4 = [
    Case("llama", 1, {"mode": WF, "ring_count": 2}, seq_len=30, pad=3),  # 30 -> padded to 32 by the loader
    Case("qwen2", 2, {"mode": WF, "ring_count": 1, "sharding": "contiguous"}, batch_size=2),
    Case("mistral", 3, {"mode": WF, "ring_count": 2}),
    Case("mistral", 1, {"mode": UL}, pad=5),
    Case("llama", 2, {"mode": UL}, gas=2),
    Case("qwen2", 3, {"mode": UL}, batch_size=2),
    Case("qwen2", 1, {"mode": "hybrid", "ulysses_degree": 2}),
    Case("mistral", 2, {"mode": "hybrid", "ulysses_degree": 2}, seq_len=40),
    Case("llama", 3, {"mode": "hybrid", "ulysses_degree": 2, "ring_count": 1}, pad=2),
    # P = 1: four data-parallel replicas, no sequence parallelism (local attention, no collective), with MsT too
    Case("llama", 2, {"sequence_parallel_size": 1}, pad=3),
    Case("qwen2", 3, {"sequence_parallel_size": 1, "mini_sequence": {"mlp_chunk_tokens": 7}}),
]
# 1 rank: the single-GPU case (MsT's home), with and without MsT
CASES_1 = [
    Case("mistral", 2, {}, seq_len=30, pad=2),
    Case("llama", 3, {"mode": "auto", "mini_sequence": {"lm_head_chunk_tokens": 9}}),
]
# 8 ranks: hybrid U = 2 around multi-ring (R = 4, C = 2); and P = 4 x D = 2 data-parallel replicas
CASES_8 = [
    Case("llama", 3, {"mode": "hybrid", "ulysses_degree": 2, "ring_count": 2}),
    Case("qwen2", 2, {"sequence_parallel_size": 4, "mode": WF, "ring_count": 2}, gas=2),
]
# 2 ranks: Ulysses with split kv heads (U = 2 = hk), ring attention, and MsT (chunked MLP + LM head) inside
CASES_2 = [
    Case("mistral", 3, {"mode": UL}, seq_len=36, pad=4),
    Case("llama", 2, {"mode": WF,
                      "mini_sequence": {"mlp_chunk_tokens": 6, "lm_head_chunk_tokens": 5, "activation_checkpointing": "none"}}),
    Case("qwen2", 1, {"mode": "hybrid", "ulysses_degree": 2,
                      "mini_sequence": {"activation_checkpointing": "deepspeed"}}),
]


@pytest.mark.parametrize("world,cases", [(1, CASES_1), (2, CASES_2), (4, CASES_4), (8, CASES_8)],
                         ids=["W1", "W2", "W4", "W8"])
def test_matches_non_parallel_run(world: int, cases: list[Case]) -> None:
    results = run_distributed(run_cases, world, _run_case, cases, timeout_s=420)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])
