"""MiniSequenceConfig parsing, validation and the "auto" rules (pure, no processes)."""
from __future__ import annotations

import pytest

from ds_wallfacer.mst import MiniSequenceConfig, resolve_sizes


def test_defaults() -> None:
    cfg = MiniSequenceConfig.from_dict({})
    assert cfg == MiniSequenceConfig.from_dict(None) == MiniSequenceConfig()
    assert (cfg.mlp, cfg.lm_head, cfg.mlp_chunk_tokens, cfg.lm_head_chunk_tokens) == (True, True, "auto", "auto")
    assert cfg.lm_head_logits_budget_mib == 256 and cfg.activation_checkpointing == "deepspeed"
    assert cfg.mlp_module_names is None


def test_full_dict() -> None:
    cfg = MiniSequenceConfig.from_dict(
        {
            "mlp": False,
            "mlp_chunk_tokens": 2048,
            "lm_head": True,
            "lm_head_chunk_tokens": "auto",
            "lm_head_logits_budget_mib": 64,
            "activation_checkpointing": "torch",
            "mlp_module_names": ["mlp"],
        }
    )
    assert cfg.mlp_chunk_tokens == 2048 and cfg.mlp_module_names == ("mlp",)


@pytest.mark.parametrize(
    "key,value",
    [
        ("mlp_chunk_tokens", 0),
        ("mlp_chunk_tokens", -3),
        ("mlp_chunk_tokens", 1.5),
        ("mlp_chunk_tokens", "512"),
        ("mlp_chunk_tokens", True),
        ("lm_head_chunk_tokens", 0),
        ("lm_head_chunk_tokens", "big"),
        ("lm_head_logits_budget_mib", 0),
        ("lm_head_logits_budget_mib", "auto"),
        ("activation_checkpointing", "megatron"),
        ("mlp", "yes"),
        ("mlp_module_names", []),
        ("mlp_module_names", "mlp"),
    ],
)
def test_bad_values_name_key_value_and_rule(key: str, value: object) -> None:
    with pytest.raises(ValueError) as err:
        MiniSequenceConfig.from_dict({key: value})
    msg = str(err.value)
    shown = tuple(value) if isinstance(value, list) else value  # lists arrive as tuples
    assert key in msg and repr(shown) in msg and "allowed" in msg, msg


def test_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['chunks'\].*valid keys"):
        MiniSequenceConfig.from_dict({"chunks": 4})
    with pytest.raises(ValueError, match="must be a JSON object"):
        MiniSequenceConfig.from_dict([1])  # type: ignore[arg-type]


def test_frozen() -> None:
    with pytest.raises(AttributeError):
        MiniSequenceConfig().mlp = False  # type: ignore[misc]


def test_resolve_auto() -> None:
    cfg = MiniSequenceConfig()
    # Llama-3-8B shape at 60K local tokens: d / 4 tokens per MLP mini-sequence; fp32 logits chunk within 256 MiB
    r = resolve_sizes(cfg, tokens=61_440, hidden_size=4096, vocab_size=128_256)
    assert r.mlp_chunk_tokens == 1024 and r.mlp_chunks == 60
    assert r.lm_head_chunk_tokens == (256 << 20) // (4 * 128_256) == 523
    assert r.lm_head_chunk_tokens * 128_256 * 4 <= 256 << 20
    assert r.lm_head_chunks == -(-61_440 // 523)
    # shorter than one chunk: one mini-sequence, nothing dropped
    r = resolve_sizes(MiniSequenceConfig(mlp_chunk_tokens=100), tokens=7, hidden_size=64, vocab_size=10)
    assert (r.mlp_chunk_tokens, r.mlp_chunks, r.lm_head_chunks) == (100, 1, 1)
    # a vocabulary whose one-token logits exceed the budget still gets 1 token per chunk
    r = resolve_sizes(MiniSequenceConfig(lm_head_logits_budget_mib=1), tokens=3, hidden_size=8, vocab_size=10**6)
    assert r.lm_head_chunk_tokens == 1 and r.lm_head_chunks == 3
    with pytest.raises(ValueError, match="hidden_size > 0"):
        resolve_sizes(cfg, tokens=1, hidden_size=0, vocab_size=1)
