"""RoPE parity under sequence parallelism for every ``rope_type`` transformers ships (default, linear, dynamic,
yarn, longrope, llama3, proportional), each at a length where its scaling is active. ``dynamic`` and ``longrope``
choose their frequencies from ``max(position_ids) + 1``, which a rank's zigzag shard does not show; the others are
fixed by the config. Step-0 loss and every parameter after 2 SGD steps (clipping off) must match the unmodified
model trained in one process; lengths of 30 are padded to 32 by the loader (the model must still see 30).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.dist_utils import run_distributed

from .models import full_batch, hf_loss
from .parity import param_failures
from .variants import tiny_rope

LR = 0.5
STEPS = 2


@dataclass(frozen=True)
class Case:
    rope_type: str
    wallfacer: dict
    seq_len: int
    family: str = "llama"
    stage: int = 1

    def name(self) -> str:
        return f"{self.family}/{self.rope_type}/{self.wallfacer}/N={self.seq_len}"


def _reference(case: Case) -> tuple[list[float], dict]:
    ref = tiny_rope(case.rope_type, family=case.family)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = hf_loss(ref, full_batch(case.seq_len, batch_size=1, seed=step))
        losses.append(loss.item())
        loss.backward()
        opt.step()
    return losses, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _run_case(rank: int, world: int, case: Case) -> list[str]:
    from ds_wallfacer.integration import initialize

    ours = tiny_rope(case.rope_type, family=case.family)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": case.stage},
           "zero_allow_untested_optimizer": True, "wallfacer": case.wallfacer}
    engine, sp = initialize(model=ours, config=cfg, optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    ref_losses, ref_params = _reference(case)
    failures = []
    for step in range(STEPS):
        loss = engine(**sp.shard(full_batch(case.seq_len, batch_size=1, seed=step)))
        if step == 0 and abs(loss.item() - ref_losses[0]) > 1e-5 * max(1.0, abs(ref_losses[0])):
            failures.append(f"step 0 loss {loss.item():.7f} != non-parallel {ref_losses[0]:.7f}")
        engine.backward(loss)
        engine.step()
    failures += param_failures(engine, ref_params, steps=STEPS)
    engine.destroy()
    return [f"[{case.name()}] rank {rank}: {f}" for f in failures]


def _run_cases(rank: int, world: int, cases: list[Case]) -> list[str]:
    failures = []
    for case in cases:
        failures += _run_case(rank, world, case)
    return failures


WF = {"mode": "wallfacer", "ring_count": 1}
CASES_4 = [
    Case("default", WF, 32),
    Case("linear", {"mode": "ulysses"}, 32),
    Case("dynamic", WF, 30),  # NTK base from 30 > max_position_embeddings 16 (not 32, not a shard's length)
    Case("dynamic", {"mode": "hybrid", "ulysses_degree": 2}, 32, stage=3),
    Case("yarn", {"mode": "hybrid", "ulysses_degree": 2}, 32),
    Case("longrope", WF, 24),  # long factors: 24 > original 16; rank 3 (pieces 3, 4) ends at position 14
    Case("longrope", {"mode": "ulysses"}, 30, family="phi3", stage=2),
    Case("llama3", {"mode": "wallfacer", "ring_count": 2}, 32),
    Case("proportional", WF, 32),
]


def test_every_rope_type_matches_non_parallel_run() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert {c.rope_type for c in CASES_4} == {"default", *ROPE_INIT_FUNCTIONS}
    results = run_distributed(_run_cases, 4, CASES_4, timeout_s=420)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])
