"""Dynamic sequence parallelism against the fixed-P run of the same rows (``SequenceParallelLoader``, the same
seed and batch sizes): the losses and every parameter after each SGD step (clipping off) within 1e-5 in fp32, on
4 and 8 CPU ranks, dense rows and packed documents mixed, with groups of several sizes in one round; what it
cannot run is refused at start-up. (A resumed run continues bitwise: ``tests/train/test_modes.py``.)"""
from __future__ import annotations

import pytest
import torch

from tests.dist_utils import run_distributed
from tests.integration.parity import parity_config
from tests.models import tiny_model

LENGTHS = (8, 12, 96, 20, 24, 40, 16, 10, 14, 30, 18, 120)
"""Rows of 8-120 tokens: at most 128 / P per rank, short rows fit one rank, the longest needs all P."""


def _rows() -> list[dict]:
    """Dense rows and rows of two packed documents, mixed."""
    g = torch.Generator().manual_seed(1)
    rows = []
    for i, n in enumerate(LENGTHS):
        ids = torch.randint(0, 256, (n,), generator=g)
        rows.append({"input_ids": ids, "document_lengths": [n // 3, n - n // 3]} if i % 2 and n > 16
                    else {"input_ids": ids})
    return rows


def _engine(wallfacer: dict, *, stage: int, micro: int, gas: int, dynamic: bool):
    from ds_wallfacer.integration import initialize

    model = tiny_model("llama", seed=0)
    wf = {**wallfacer, "self_check": False}
    if dynamic:
        # the 120-token row needs all P ranks; the shortest fit one
        wf["dynamic_sequence_parallel"] = {"max_tokens_per_rank": 128 // wallfacer["sequence_parallel_size"]}
    cfg = parity_config(stage=stage, wallfacer=wf, micro_batch=micro, gradient_accumulation_steps=gas)
    return initialize(model=model, config=cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.5))


def _params(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _dynamic_step(engine, step) -> float:
    """One optimizer step over this rank's rounds; the step's loss (every rank's shares summed)."""
    import torch.distributed as dist

    acc = torch.zeros(1, dtype=torch.float64)
    for batch in step:
        loss = engine(**batch)
        engine.backward(loss)
        acc += float(loss.detach())
    engine.step()
    dist.all_reduce(acc)
    return float(acc) / (dist.get_world_size() * engine.gradient_accumulation_steps())


def _parity(rank: int, world: int, wallfacer: dict, stage: int, micro: int, gas: int) -> dict:
    import torch.distributed as dist

    rows = _rows()
    engine, sp = _engine(wallfacer, stage=stage, micro=micro, gas=gas, dynamic=False)
    fixed_losses, fixed_params = [], []
    total = torch.zeros(1, dtype=torch.float64)
    for i, batch in enumerate(sp.dataloader(rows, shuffle=True, seed=3)):
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        total += float(loss.detach())
        if (i + 1) % gas == 0:  # the step's loss: micro-batches averaged, then replicas (each rank of a group alike)
            dist.all_reduce(total)
            fixed_losses.append(float(total) / (world * gas))
            fixed_params.append(_params(engine))
            total.zero_()
    engine.destroy()
    engine, sp = _engine(wallfacer, stage=stage, micro=micro, gas=gas, dynamic=True)
    dyn_losses, errors, sizes = [], [], []
    for k, step in enumerate(sp.dataloader(rows, shuffle=True, seed=3)):
        dyn_losses.append(_dynamic_step(engine, step))
        sizes.append(step.sizes)
        got = _params(engine)
        errors.append(max(((got[n] - w).abs() / w.abs().clamp(min=1)).max().item()
                          for n, w in fixed_params[k].items()))
    engine.destroy()
    return dict(fixed=fixed_losses, dynamic=dyn_losses, param_err=errors, sizes=sizes)


CASES = [
    pytest.param(4, {"sequence_parallel_size": 2, "mode": "ulysses"}, 3, 1, 3, id="4-ranks-ulysses-P2-zero3-gas3"),
    pytest.param(8, {"sequence_parallel_size": 8, "mode": "hybrid", "ulysses_degree": 2}, 1, 6, 1,
                 id="8-ranks-hybrid-zero1"),
]
"""ZeRO-2 and WallFacer's ring: the trainer's test (``tests/train/test_modes.py``) and ``bench_dynamic_sp.py``."""


@pytest.mark.parametrize("world, wallfacer, stage, micro, gas", CASES)
def test_dynamic_trains_like_the_fixed_run(world, wallfacer, stage, micro, gas) -> None:
    out = run_distributed(_parity, world, wallfacer, stage, micro, gas, timeout_s=600)
    r = out[0]
    assert len(r["dynamic"]) == len(r["fixed"]) == len(LENGTHS) // (micro * gas * world // wallfacer["sequence_parallel_size"])
    for got, want in zip(r["dynamic"], r["fixed"]):
        assert abs(got - want) <= 1e-5 * max(1.0, abs(want)), (r["dynamic"], r["fixed"])
    assert max(r["param_err"]) <= 1e-5, r["param_err"]
    used = {p for step in r["sizes"] for p in step}
    assert len(used) >= 2 and 1 in used, r["sizes"]  # several group sizes, and rows with no sequence parallelism


def _refused(rank: int, world: int, section: dict, stage: int) -> str:
    from ds_wallfacer.integration import initialize

    model = tiny_model("llama", seed=0)
    cfg = parity_config(stage=stage, wallfacer={"sequence_parallel_size": 2, "self_check": False, **section})
    try:
        initialize(model=model, config=cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    except ValueError as e:
        return str(e)
    return "not refused"


def test_zero3_with_mini_sequence_is_refused_at_start_up() -> None:
    msg = run_distributed(_refused, 2, {"dynamic_sequence_parallel": {}, "mini_sequence": {}}, 3)[0]
    assert "ZeRO stage 3 and wallfacer.mini_sequence" in msg, msg
