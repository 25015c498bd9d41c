"""Mixture-of-experts parity with the router aux loss on: real DeepSpeed engines on gloo CPU ranks, tiny Mixtral /
Qwen2-MoE / Qwen3-MoE from config, every sequence-parallel mode, with and without MsT. Step-0 loss and every
parameter after 3 SGD steps (clipping off) must match the unmodified model trained in one process, whose loss is
``model(input_ids, labels).loss`` = token-mean CE + ``router_aux_loss_coef`` x load-balancing loss.
"""
from __future__ import annotations

import torch

from tests.adapters.models import AUX_COEF, MOE_FAMILIES, tiny_moe
from tests.dist_utils import run_distributed
from tests.integration.models import full_batch
from tests.integration.parity import Case, finish, first_step_failures, parity_config, run_cases, train

LR = 0.5
STEPS = 3


def _ds_config(case: Case) -> dict:
    return parity_config(stage=case.stage, wallfacer=case.wallfacer, micro_batch=case.batch_size)


def _ref_loss(model: torch.nn.Module, batch: dict, pad: int) -> torch.Tensor:
    # with padding, the batch's attention mask tells HF which tokens the aux loss counts (right padding leaves the
    # LM loss as without a mask)
    mask = batch["attention_mask"] if pad else None
    return model(input_ids=batch["input_ids"], attention_mask=mask, labels=batch["labels"]).loss


def _reference(case: Case, dp: int) -> tuple[dict, dict, dict]:
    ref = tiny_moe(case.family)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses, aux = {}, {}
    for step in range(STEPS):
        opt.zero_grad()
        for d in range(dp):
            batch = full_batch(case.seq_len, batch_size=case.batch_size, seed=step * 10 + d, pad=case.pad)
            out = ref(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"] if case.pad else None,
                      labels=batch["labels"])
            losses[(step, d)], aux[(step, d)] = out.loss.item(), out.aux_loss.item()
            (out.loss / dp).backward()
        opt.step()
    return losses, aux, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _run_case(rank: int, world: int, case: Case) -> list[str]:
    from ds_wallfacer.integration import initialize

    ours = tiny_moe(case.family)
    engine, sp = initialize(model=ours, config=_ds_config(case), optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    assert sp.module.router_aux is not None and sp.module.router_aux.coef == AUX_COEF
    if "mini_sequence" in case.wallfacer:  # MsT on: MoE blocks left alone with a note, dense MLPs chunked
        ms = sp.mini_sequence
        assert ms.skipped and all("mixture-of-experts" in why for why in ms.skipped.values()), ms.skipped
        assert ms.lm_head is not None
        if case.family == "qwen2_moe":
            assert ms.mlp_modules == ["model.layers.1.mlp"], ms.mlp_modules
    dp, d = sp.setup.dims.dp_size, sp.groups.dp_index
    ref_losses, ref_aux, ref_params = _reference(case, dp)

    def check(step: int, loss: torch.Tensor) -> list[str]:
        if step:
            return []
        return (first_step_failures(loss.item(), ref_losses[(0, d)])
                + first_step_failures(sp.module.last_aux_loss.item(), ref_aux[(0, d)], "aux loss"))

    batches = (full_batch(case.seq_len, batch_size=case.batch_size, seed=step * 10 + d, pad=case.pad)
               for step in range(STEPS))
    failures = train(engine, sp, batches, check)
    return finish(engine, ref_params, failures, steps=STEPS, name=case.name(), rank=rank)


WF, UL = "wallfacer", "ulysses"
_MST = {"activation_checkpointing": "torch", "lm_head_chunk_tokens": 5, "mlp_chunk_tokens": 6}
CASES_4 = [
    # every mode, each without and with MsT; padding (loader's and the batch's own), batch > 1, ZeRO 1/2/3
    Case("mixtral", 1, {"mode": WF, "ring_count": 1}),
    Case("qwen2_moe", 2, {"mode": WF, "ring_count": 2}, pad=3, seq_len=30),
    Case("qwen3_moe", 3, {"mode": UL}, batch_size=2),
    Case("mixtral", 2, {"mode": "hybrid", "ulysses_degree": 2}, pad=2),
    Case("qwen2_moe", 1, {"mode": WF, "ring_count": 1, "mini_sequence": _MST}),
    Case("mixtral", 3, {"mode": WF, "ring_count": 2, "mini_sequence": {**_MST, "activation_checkpointing": "none"}}),
    Case("qwen2_moe", 2, {"mode": UL, "mini_sequence": _MST}, pad=3, seq_len=30),
    Case("qwen3_moe", 1, {"mode": "hybrid", "ulysses_degree": 2, "mini_sequence": _MST}),
    # two data-parallel replicas of P = 2: the aux statistics are summed within a group only
    Case("qwen2_moe", 2, {"sequence_parallel_size": 2, "mode": WF}, batch_size=2),
]


def test_moe_aux_loss_matches_non_parallel_run() -> None:
    assert {c.family for c in CASES_4} == set(MOE_FAMILIES)
    results = run_distributed(run_cases, 4, _run_case, CASES_4, timeout_s=420)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures[:40])


def test_sequence_parallel_statistics_are_not_a_mean_of_local_losses() -> None:
    """Summing the per-token statistics of two shards reproduces the model's aux loss over the whole sequence;
    averaging per-shard aux losses does not (so the test above can tell the two apart)."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    from ds_wallfacer.adapters.moe import RouterAuxLoss

    spec = RouterAuxLoss(num_experts=4, top_k=2, coef=AUX_COEF)
    g = torch.Generator().manual_seed(1)
    # two layers, 16 tokens, routing skewed differently in the two halves of the sequence
    logits = tuple(torch.randn(16, 4, generator=g) + torch.tensor([3.0, 0, 0, 0]).repeat(16, 1)
                   * (torch.arange(16) < 8).float()[:, None] for _ in range(2))
    want = load_balancing_loss_func(logits, 4, 2)
    halves = [tuple(x[:8] for x in logits), tuple(x[8:] for x in logits)]
    total = sum(spec.statistics(h, None).double() for h in halves)
    assert torch.allclose(spec.combine(total), want, rtol=1e-6)
    local_mean = sum(load_balancing_loss_func(h, 4, 2) for h in halves) / 2
    assert not torch.allclose(local_mean, want, rtol=1e-2)
