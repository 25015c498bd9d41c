"""The start-up self-check, through ``initialize`` on 4 ranks (one launch): it refuses, on its own, an attention
layer that scales queries by a local ``torch.arange`` once the static rules are told to let it through (and the
static rules refuse it first); the refusal names the parameters and is the same on every rank; a correct model
passes under ZeRO-3 with Mini-Sequence chunking, also when ZeRO-3 partitioned it at construction (zero.Init); the
check leaves no gradients, no counted traffic and the random stream as it was."""
from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import LlamaAttention

from tests.dist_utils import run_distributed
from tests.models import tiny_model


class _ScaledByLocalPosition(LlamaAttention):
    """A patched attention that scales its input by position, read from a local ``arange`` (as Llama 4's NoPE
    temperature tuning does): under sequence parallelism each rank sees its own shard's positions."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        pos = torch.arange(hidden_states.shape[1], dtype=hidden_states.dtype)
        return super().forward(hidden_states * (1.0 + pos / 64.0)[None, :, None], *args, **kwargs)


def _broken() -> torch.nn.Module:
    model = tiny_model("llama")
    for layer in model.model.layers:
        layer.self_attn.__class__ = _ScaledByLocalPosition
    return model


def _config(stage: int = 1, **wallfacer) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True, "wallfacer": {"mode": "hybrid", **wallfacer}}


def _init(model: torch.nn.Module, config: dict):
    import ds_wallfacer.integration as wfi

    return wfi.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _refusal(model: torch.nn.Module, config: dict) -> str:
    from ds_wallfacer.audit.model_audit import RefusedModel

    try:
        _init(model, config)
    except RefusedModel as err:
        return str(err)
    return "not refused"


def _body(rank: int, world: int) -> dict:
    out = {
        "static": _refusal(_broken(), _config()),
        "self_check": _refusal(_broken(), _config(allow_modules=["_ScaledByLocalPosition"])),
    }
    engine, _ = _init(_broken(), _config(allow_modules=["_ScaledByLocalPosition"], self_check=False))
    out["opted_out"] = engine is not None
    states = []
    for check in (False, True):
        torch.manual_seed(7)
        model = tiny_model("llama")
        engine, sp = _init(model, _config(3, mini_sequence={}, self_check=check))
        states.append(torch.get_rng_state())
        out[f"grads_{check}"] = [n for n, p in model.named_parameters() if p.grad is not None]
        out[f"sent_{check}"] = sum(sp.comm.sent.values())
    out["rng_kept"] = torch.equal(states[0], states[1])
    # a model ZeRO-3 partitioned at construction (zero.Init, as from_pretrained under HfDeepSpeedConfig) is
    # gathered for the check, and the check still refuses what differs
    import deepspeed

    for name, build in (("zero_init", lambda: tiny_model("llama")), ("zero_init_broken", _broken)):
        config = _config(3, allow_modules=["_ScaledByLocalPosition"])
        with deepspeed.zero.Init(config_dict_or_path={k: v for k, v in config.items() if k != "wallfacer"}):
            model = build()
        out[f"{name}_partitioned"] = all(p.numel() == 0 for p in model.parameters())
        out[name] = _refusal(model, config)
    return out


def test_self_check_refuses_what_the_rules_let_through() -> None:
    results = run_distributed(_body, 4, timeout_s=600)
    first = results[0]
    for r in results:  # one message, the same on every rank
        assert r["static"] == first["static"] and r["self_check"] == first["self_check"]
    assert "(_ScaledByLocalPosition)" in first["static"] and "torch.arange" in first["static"], first["static"]
    msg = first["self_check"]
    assert "the start-up self-check" in msg and "found that sequence parallelism changes the result" in msg, msg
    assert "model.layers.0.self_attn.q_proj.weight: relative error" in msg, msg
    assert '"self_check": false' in msg
    assert first["opted_out"]
    assert first["rng_kept"]
    assert first["grads_True"] == [] and first["sent_True"] == first["sent_False"] == 0
    assert first["zero_init_partitioned"] and first["zero_init"] == "not refused"
    assert first["zero_init_broken_partitioned"] and "self-check" in first["zero_init_broken"]
