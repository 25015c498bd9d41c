"""The start-up audit: every refusal is raised by ``initialize`` on every rank, before any collective (no hang),
and names the setting to change; LM heads with logit scaling or final soft-capping (Granite, Cohere, Gemma-2) train
like the non-parallel model in both the Mini-Sequence head and the plain logits path; the "valid sizes" that a bad
``sequence_parallel_size`` lists all train. One 4-rank launch."""
from __future__ import annotations

import re

import torch
from torch import nn

from tests.adapters.models import tiny_head, tiny_moe, tiny_rope
from tests.dist_utils import run_distributed
from tests.integration.models import full_batch, hf_loss, tiny_model
from tests.models import TINY_CONFIG

LR = 0.5
STEPS = 2
_TORCH_CKPT = {"activation_checkpointing": "torch"}


def _config(wallfacer: dict, stage: int = 1) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "wallfacer": wallfacer}


class _RemoteCodeRotary(nn.Module):
    """A rotary embedding as trust_remote_code models write it: "dynamic" NTK computed from the positions it is
    given, without transformers' ``dynamic_rope_update`` (so it cannot be shown the global length)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.rope_type, self.config = inner.rope_type, inner.config
        self.inv_freq = inner.inv_freq
        self.attention_scaling = inner.attention_scaling

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        n = int(position_ids.max()) + 1
        base = 10000.0 * max(1.0, n / self.config.max_position_embeddings)
        inv = 1.0 / (base ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
        freqs = position_ids[..., None].float() * inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _falcon_h1() -> nn.Module:
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier``, a scaling the mini-sequence LM head does not know."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    t = TINY_CONFIG
    return FalconH1ForCausalLM(FalconH1Config(
        hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"], num_attention_heads=4,
        num_key_value_heads=2, vocab_size=t["vocab_size"], max_position_embeddings=t["max_position_embeddings"],
        num_hidden_layers=2, head_dim=16, mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
        mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16, lm_head_multiplier=0.5)).train()


def _with(family: str, **config) -> nn.Module:
    """``tiny_model(family)`` rebuilt from its config with ``config`` changed (modules read it at construction)."""
    cfg = tiny_model(family).config
    for k, v in config.items():
        setattr(cfg, k, v)
    return type(tiny_model(family))(cfg).train()


def _moe_reentrant() -> nn.Module:
    model = tiny_moe("mixtral")
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
    return model


def _remote_rope() -> nn.Module:
    model = tiny_rope("dynamic")
    model.model.rotary_emb = _RemoteCodeRotary(model.model.rotary_emb)
    return model


# (name, model factory, wallfacer section, initialize kwargs, text the error must contain)
REFUSALS = [
    ("attention dropout", lambda: _with("llama", attention_dropout=0.1), {}, {}, "set attention_dropout=0.0"),
    ("attention soft-capping with a kernel that cannot", lambda: tiny_head("gemma2", attn_logit_softcapping=50.0),
     {"kernel": "cpu_flash"}, {}, "which kernel 'cpu_flash' cannot apply (kernels that can: ['reference'"),
    ("sliding window with a kernel that cannot mask", lambda: _with("mistral", sliding_window=8),
     {"kernel": "flash_attn"}, {"seq_len": 32}, "which kernel 'flash_attn' cannot mask"),
    ("MoE aux loss under reentrant checkpointing", lambda: tiny_moe("mixtral"), {"mini_sequence": {}}, {},
     '"activation_checkpointing": "torch"'),
    ("MoE aux loss under reentrant HF checkpointing", _moe_reentrant, {}, {}, '{"use_reentrant": False}'),
    ("MoE z-loss", lambda: tiny_moe("qwen2_moe", router_z_loss_coef=0.001), {}, {}, "set output_router_logits=False"),
    ("RoPE that cannot see the global length", _remote_rope, {}, {}, "set rope_parameters.rope_type"),
    ("LM head scaling of unknown semantics", _falcon_h1, {"mini_sequence": _TORCH_CKPT}, {},
     '"mini_sequence": {"lm_head": false}'),
    ("MoE block forced as a mini-sequence MLP", lambda: tiny_moe("mixtral"),
     {"mini_sequence": {**_TORCH_CKPT, "mlp_module_names": ["mlp"]}}, {}, "mixture-of-experts block"),
]


def _refusals(rank: int) -> list[str]:
    from ds_wallfacer.integration import initialize

    failures = []
    for name, make, wallfacer, kwargs, want in REFUSALS:
        model = make()
        try:
            initialize(model=model, config=_config(wallfacer), optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                       **kwargs)
            failures.append(f"{name}: initialize accepted the model")
        except ValueError as err:
            if want not in str(err):
                failures.append(f"{name}: message does not say {want!r}: {err}")
    return failures


def _train(rank: int, model_fn, wallfacer: dict, label: str, seq_len: int = 32) -> list[str]:
    """Loss at step 0 and every parameter after STEPS SGD steps vs. the unmodified model in one process."""
    from deepspeed.utils import safe_get_full_fp32_param

    from ds_wallfacer.integration import initialize

    ours, ref = model_fn(), model_fn()
    engine, sp = initialize(model=ours, config=_config(wallfacer), optimizer=torch.optim.SGD(ours.parameters(), lr=LR))
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    failures = []
    for step in range(STEPS):
        batch = full_batch(seq_len, batch_size=1, seed=step)
        loss = engine(**sp.shard(batch))
        want = hf_loss(ref, batch)
        if step == 0 and abs(loss.item() - want.item()) > 1e-5 * max(1.0, abs(want.item())):
            failures.append(f"{label}: step 0 loss {loss.item():.7f} != non-parallel {want.item():.7f}")
        engine.backward(loss)
        engine.step()
        opt.zero_grad()
        want.backward()
        opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in engine.module.named_parameters():
        key = name.removeprefix("lm.")
        w = safe_get_full_fp32_param(p)
        if not torch.allclose(w, ref_params[key].detach(), rtol=1e-4, atol=2e-6):
            failures.append(f"{label}: param {key} max err {(w - ref_params[key]).abs().max().item():.3g}")
    engine.destroy()
    return failures


HEADS = [
    ("granite", {"mode": "wallfacer", "mini_sequence": {**_TORCH_CKPT, "lm_head_chunk_tokens": 5}}),
    ("granite", {"mode": "ulysses"}),
    ("hyperclovax", {"mode": "ulysses", "mini_sequence": {**_TORCH_CKPT, "lm_head_chunk_tokens": 5}}),
    ("cohere", {"mode": "hybrid", "ulysses_degree": 2, "mini_sequence": {**_TORCH_CKPT, "lm_head_chunk_tokens": 3}}),
    ("gemma2", {"mode": "wallfacer", "mini_sequence": {**_TORCH_CKPT, "lm_head_chunk_tokens": 5}}),
    ("gemma2", {"mode": "wallfacer"}),
]


# a bad sequence_parallel_size beside other settings, and the sizes its error must list (each must train)
SIZE_CONFIGS = [
    ({}, [1, 2, 4]),
    ({"mode": "wallfacer", "ring_count": 2}, [4]),  # C = 2 needs C*C | P
    ({"mode": "hybrid", "ulysses_degree": 2}, [2, 4]),
]


def _valid_sizes(rank: int, world: int) -> tuple[list[list[int]], list[str]]:
    from ds_wallfacer.integration import initialize

    listed, failures = [], []
    for extra, _ in SIZE_CONFIGS:
        model = tiny_model("llama")
        try:
            initialize(model=model, config=_config({"sequence_parallel_size": 3, **extra}),
                       optimizer=torch.optim.SGD(model.parameters(), lr=LR))
            failures.append(f"sequence_parallel_size 3 on 4 ranks was accepted with {extra}")
            continue
        except ValueError as err:
            found = re.search(r"valid sizes for \d+ ranks are \[([\d, ]*)\]", str(err))
            if not found:
                failures.append(f"no list of valid sizes in: {err}")
                continue
        sizes = [int(s) for s in found.group(1).split(",") if s.strip()]
        listed.append(sizes)
        for p in sizes:
            failures += _train(rank, lambda: tiny_model("llama"), {"sequence_parallel_size": p, **extra},
                               f"P={p} {extra}")
    return listed, failures


def _body(rank: int, world: int) -> dict:
    refusals = _refusals(rank)
    heads = []
    for family, wallfacer in HEADS:
        heads += _train(rank, lambda f=family: tiny_head(f), wallfacer, f"{family} {wallfacer}")
    sizes, size_failures = _valid_sizes(rank, world)
    return {"refusals": refusals, "heads": heads, "sizes": sizes, "size_failures": size_failures}


def test_audit_refusals_head_variants_and_valid_sizes() -> None:
    results = run_distributed(_body, 4, timeout_s=400)
    for key in ("refusals", "heads", "size_failures"):
        failures = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res[key]]
        assert not failures, f"{key}:\n" + "\n".join(failures[:30])
    want = [sizes for _, sizes in SIZE_CONFIGS]
    assert all(res["sizes"] == want for res in results), [res["sizes"] for res in results]
