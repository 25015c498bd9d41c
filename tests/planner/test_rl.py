"""The GRPO step model (``planner/rl.py``): the KV cache's size, the decode sum against its closed form, the split's
share of generation and memory, and the ``--rl grpo`` command (pure, in-process)."""
import json
from dataclasses import replace

import pytest

from ds_wallfacer.planner import CLUSTERS, MODELS, Workload, plan
from ds_wallfacer.planner.cli import main
from ds_wallfacer.planner.rl import DECODERS, Rollout, decode_s, kv_bytes_per_token, plan_rl, rl_step

GIB = 2**30


def test_kv_cache_of_llama3_8b():
    """32 layers x 8 kv heads x (128 + 128) dims x 2 bytes: 128 KiB a token; 64 completions of 16K: 128 GiB."""
    kv = kv_bytes_per_token(MODELS["llama3-8b"])
    assert kv == 128 * 1024
    assert 64 * 16384 * kv == 128 * GIB


def test_decode_is_the_closed_form_when_bound_by_reads():
    """With unlimited arithmetic every decode step costs its reads over the rate plus the overheads: the sum over
    steps t = 0..L-1 of (weights + n (prompt + t + 1) kv) / rate, which the slices add up exactly (linear in t)."""
    model, dec = MODELS["llama3-8b"], DECODERS["vllm"]
    cluster = replace(CLUSTERS["h100x8"], flops=1e30)
    n, prompt, length = 8, 1000, 4096
    got = decode_s(model, cluster, dec, sequences=n, prompt_len=prompt, completion_len=length)
    rate = cluster.mem_bw * dec.bandwidth_efficiency
    reads = length * 2 * model.params + n * kv_bytes_per_token(model) * (length * prompt + length * (length + 1) / 2)
    want = reads / rate + length * dec.step_overhead_s
    assert got == pytest.approx(want, rel=1e-9)


def test_split_generation_and_its_memory():
    """64 completions of 16K after a 1K prompt on 8 H100: each rank decodes 1/P of its group's completions and holds
    1/P of their KV cache; generating the group's whole batch on every rank runs out of memory."""
    model, cluster = MODELS["llama3-8b"], CLUSTERS["h100x8"]
    rollout = Rollout(completions=64, prompt_len=1024, completion_len=16384)
    pl, (split, redundant) = plan_rl(cluster, model, rollout, fixed={}, workload=Workload(seq_len=rollout.seq_len))
    p, d = pl.choice.sp_size, pl.choice.dp_size
    assert split.sequences_per_rank == 64 // d // p and redundant.sequences_per_rank == 64 // d
    assert redundant.kv_cache_bytes == p * split.kv_cache_bytes
    assert split.kv_cache_bytes == split.sequences_per_rank * rollout.seq_len * 128 * 1024
    assert split.fits and not redundant.fits
    assert split.generation_s < redundant.generation_s
    assert split.training_s == redundant.training_s > 0 and split.scoring_reference_s > 0
    assert split.scoring_policy_s == 0  # no importance sampling asked for
    vllm = plan_rl(cluster, model, replace(rollout, backend="vllm"), fixed={},
                   workload=Workload(seq_len=rollout.seq_len))[1]
    assert len(vllm) == 1 and vllm[0].generation_s < split.generation_s  # no launch overhead per layer


def test_rl_step_refuses_a_row_planned_for_other_sequences():
    model, cluster = MODELS["llama3-8b"], CLUSTERS["h100x8"]
    workload = Workload(seq_len=8192)
    row = plan(cluster, model, 8192, workload=workload).rows[0]
    with pytest.raises(ValueError, match="planned for 1 x 8192 tokens"):
        rl_step(model, cluster, Rollout(completions=8, prompt_len=1024, completion_len=16384), row, workload,
                split=True)
    with pytest.raises(ValueError, match="backend 'sglang'"):
        Rollout(completions=8, prompt_len=1, completion_len=1, backend="sglang")


def test_rl_command(capsys):
    assert main(["--cluster", "h100x8", "--model", "llama3-8b", "--rl", "grpo", "--completion-len", "16384,32768",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["completion_len"], r["backend"], r["split"]) for r in rows] == [
        (n, b, s) for n in (16384, 32768) for b, s in (("transformers", True), ("transformers", False),
                                                      ("vllm", True))]
    assert all(r["fits"] == r["split"] for r in rows)
    assert main(["--cluster", "h100x8", "--model", "llama3-8b", "--rl", "grpo", "--completion-len", "16384",
                 "--generation", "vllm"]) == 0
    assert "vllm split" in capsys.readouterr().out
