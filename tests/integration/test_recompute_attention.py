"""Attention runs once per step with decoder-layer checkpointing, through the real integration (``initialize``, a
DeepSpeed engine, 4 gloo ranks, tiny Llama / Gemma-2): DeepSpeed's and torch's layer checkpointing, with MsT (chunked
MLP + LM head) and without it (checkpointing alone, or transformers' own turned on by the caller, reentrant or not),
WallFacer C = 2, ring, Ulysses and the hybrid.

Per step, the bytes every rank sends by phase and kind, the block-kernel calls by phase and the attention work must
equal the run without checkpointing; losses and every parameter after the SGD steps match it (fp32). With
``"keep_attention": false`` the recompute runs attention again (forward kernels double): what the default removes.
Gemma-2 under DeepSpeed's checkpointing recomputes its layers twice at the first step (mst/checkpointing.py): both
recomputes replay.
"""
from __future__ import annotations

from collections import Counter

import torch

from tests.attention.counting import count_kernels
from tests.dist_utils import run_distributed

from .models import full_batch
from .parity import zero_section

LR = 0.5
STEPS = 2
SEQ = 32
TOL = dict(rtol=1e-5, atol=1e-6)
_NO_MST = {"mlp": False, "lm_head": False}  # layer checkpointing alone
_HF = "hf_checkpointing"  # not a config key: gradient_checkpointing_enable(gradient_checkpointing_kwargs=...) first

# (family, mode section, reference mini_sequence (None: absent), checkpointed mini_sequence variants)
CASES = [
    ("llama", {"mode": "wallfacer", "ring_count": 2}, {"activation_checkpointing": "none"},
     [{"activation_checkpointing": "deepspeed"}, {"activation_checkpointing": "torch"},
      {"activation_checkpointing": "deepspeed", "keep_attention": False}]),
    ("llama", {"mode": "wallfacer", "ring_count": 1}, None,
     [{**_NO_MST, "activation_checkpointing": "torch"}, {**_NO_MST, "activation_checkpointing": "deepspeed"}]),
    ("llama", {"mode": "ulysses"}, {"activation_checkpointing": "none"}, [{"activation_checkpointing": "torch"}]),
    ("gemma2", {"mode": "hybrid", "ulysses_degree": 2}, {"activation_checkpointing": "none"},
     [{"activation_checkpointing": "deepspeed"}]),
    # checkpointing the caller turned on with transformers' gradient_checkpointing_enable, no mini_sequence section
    ("llama", {"mode": "wallfacer", "ring_count": 2}, None,
     [{_HF: {"use_reentrant": False}}, {_HF: {"use_reentrant": True}}]),
]


def _run(rank: int, family: str, wallfacer: dict, kernels: Counter, hf_checkpointing: dict | None = None) -> dict:
    from deepspeed.utils import safe_get_full_fp32_param

    from ds_wallfacer.attention.residuals import residual_stats
    from ds_wallfacer.integration import initialize
    from tests.models import tiny_model

    # Gemma-2: eager attention in the reference (no SDPA support), no logit soft-capping (tested elsewhere)
    model = tiny_model(family, attn_implementation="eager", attn_logit_softcapping=None) if family == "gemma2" \
        else tiny_model(family)
    if hf_checkpointing is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=hf_checkpointing)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": zero_section(2),
              "zero_allow_untested_optimizer": True, "wallfacer": wallfacer}
    engine, sp = initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    leaf = getattr(sp.attention, "inner", sp.attention)
    steps = []
    for step in range(STEPS):
        batch = sp.shard(full_batch(SEQ, batch_size=1, seed=step))
        sp.comm.reset()
        kernels.clear()
        leaf.work.clear() if hasattr(leaf, "work") else None
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        steps.append(dict(loss=loss.item(), sent=dict(sp.comm.sent), kernels=dict(kernels),
                          work=dict(getattr(leaf, "work", {}))))
    params = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    stats = residual_stats(sp.model).as_dict()
    engine.destroy()
    return dict(steps=steps, params=params, stats=stats)


def _cases(rank: int, world: int) -> list[str]:
    kernels = count_kernels()
    failures = []
    for family, mode, ref_ms, variants in CASES:
        ref = _run(rank, family, {**mode, **({} if ref_ms is None else {"mini_sequence": ref_ms})}, kernels)
        for ms in variants:
            name = f"{family}/{mode}/{ms}"
            got = (_run(rank, family, dict(mode), kernels, hf_checkpointing=ms[_HF]) if _HF in ms
                   else _run(rank, family, {**mode, "mini_sequence": ms}, kernels))
            keep = ms.get("keep_attention", True)
            for step, (g, r) in enumerate(zip(got["steps"], ref["steps"])):
                if abs(g["loss"] - r["loss"]) > 1e-6 * max(1.0, abs(r["loss"])):
                    failures.append(f"{name} step {step}: loss {g['loss']:.8f} != {r['loss']:.8f}")
                if keep:
                    for what in ("sent", "kernels", "work"):
                        if g[what] != r[what]:
                            failures.append(f"{name} step {step}: {what} {g[what]} != without checkpointing {r[what]}")
                elif g["kernels"]["forward"] != 2 * r["kernels"]["forward"]:
                    failures.append(f"{name} step {step}: forward kernels {g['kernels']} not twice {r['kernels']}")
            bad = [n for n, p in got["params"].items() if not torch.allclose(p, ref["params"][n], **TOL)]
            if bad:
                failures.append(f"{name}: parameters {bad[:4]} differ after {STEPS} steps")
            s = got["stats"]
            if keep and (s["missed"] or s["kept_bytes"] or not s["stored"] or s["replayed"] < s["stored"]):
                failures.append(f"{name}: residual stats {s}")
            if not keep and s["stored"]:
                failures.append(f"{name}: residuals kept with keep_attention false: {s}")
    return failures


def test_attention_once_per_step_with_layer_checkpointing() -> None:
    results = run_distributed(_cases, 4, timeout_s=600)
    failures = [f"rank {r}: {f}" for r, per_rank in enumerate(results) for f in per_rank]
    assert not failures, "\n".join(failures[:40])
