"""RoPE parity under sequence parallelism for every ``rope_type`` transformers ships (default, linear, dynamic,
yarn, longrope, llama3, proportional), each at a length where its scaling is active. ``dynamic`` and ``longrope``
choose their frequencies from ``max(position_ids) + 1``, which a rank's zigzag shard does not show; the others are
fixed by the config. Step-0 loss and every parameter after 2 SGD steps (clipping off) must match the unmodified
model trained in one process; lengths of 30 are padded to 32 by the loader (the model must still see 30).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.adapters.models import tiny_rope
from tests.dist_utils import run_distributed
from tests.integration.models import full_batch, hf_loss
from tests.integration.parity import finish, first_step_failures, parity_config, run_cases, train

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
    cfg = parity_config(stage=case.stage, wallfacer=case.wallfacer)
    engine, sp = initialize(model=ours, config=cfg, optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    ref_losses, ref_params = _reference(case)
    batches = (full_batch(case.seq_len, batch_size=1, seed=step) for step in range(STEPS))
    failures = train(engine, sp, batches,
                     lambda step, loss: first_step_failures(loss.item(), ref_losses[0]) if step == 0 else [])
    return finish(engine, ref_params, failures, steps=STEPS, name=case.name(), rank=rank)


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
    results = run_distributed(run_cases, 4, _run_case, CASES_4, timeout_s=420)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])
