"""Tiny instances of every causal-LM class of the installed transformers, built from config (no downloads).

Shrinking rule, the same for every model: take the config class's defaults, serialize them to a dict and
rewrite each size-like key found there by its name (``_SIZES``): hidden 64; 4 attention heads and 2 kv heads
of dim 16; MLP 128; vocab 128 (bos / eos / pad ids moved below it); 4 experts, top-2, expert MLP 32; MLA
ranks 32 with rope / nope dims 8; mamba / SSM / linear-attention mixers of 4 heads x 16 (expand 1, state 16,
conv kernel <= 4); windows, attention chunks and SSM chunks of 16 tokens; 512 positions.  The layers kept are
the fewest (2, up to 4) that still show every kind of layer the full model has: per-layer lists
(``layer_types``, ``mlp_layer_types``, ...) and layer-index lists (``mlp_only_layers``, ``full_attn_idxs``, ...)
are cut to a greedy cover of their values (``_keep_layers``); period / offset / first-k style patterns are
set so that 2 layers show both kinds.  Nested configs (``text_config``, ``vision_config``, ...) are shrunk by
the same rules.  Dropout-like values (keys with ``dropout``, ``pdrop``, ``layerdrop``, ``jitter``) are 0,
``use_cache`` is False, ``tie_word_embeddings`` stays the default.  The config is rebuilt from the dict, so
its own ``__post_init__`` derives and validates the rest, and the model is built right after
``torch.manual_seed(seed)``, in fp32 and train mode, with sdpa attention where the class supports it.

``python -m tests.sweep.tiny`` builds every class, runs one forward + backward on 64 tokens, prints a table.
"""
from __future__ import annotations

import inspect
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

__all__ = ["NotBuildable", "causal_lm_classes", "build_tiny", "smoke", "SEQ", "VOCAB"]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 128, 128
EXPERTS, TOP_K, EXPERT_FFN, RANK, WINDOW, POSITIONS, SEQ = 4, 2, 32, 32, 16, 512, 64
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers")

Rule = int | Callable[[Any], Any]
_SIZES: dict[str, Rule] = {}
_FILL: dict[str, int] = {}  # keys whose default None the models cannot take (e.g. ``head_dim``): set to this


def _rule(keys: str, value: Rule, *, fill: int | None = None) -> None:
    for key in keys.split():
        _SIZES[key] = value
        if fill is not None:
            _FILL[key] = fill


def _at_most(n: int) -> Callable[[Any], Any]:
    return lambda v: min(v, n)


_rule("hidden_size d_model n_embd emb_dim embedding_dim embedding_size input_embedding_size output_embedding_size "
      "word_embed_proj_dim lru_width backbone_hidden_size mamba_d_ssm", HIDDEN)
_rule("num_attention_heads n_head n_heads num_heads attention_heads decoder_attention_heads encoder_attention_heads "
      "num_decoder_attention_heads num_encoder_attention_heads swa_num_attention_heads index_n_heads "
      "indexer_n_heads linear_num_heads linear_num_value_heads mamba_n_heads mamba_num_heads n_mamba_heads "
      "num_attention_heads_per_layer", HEADS, fill=HEADS)
_rule("num_key_value_heads num_kv_heads swa_num_key_value_heads num_query_groups linear_num_key_heads "
      "indexer_kv_heads", KV_HEADS, fill=KV_HEADS)
_rule("head_dim attention_head_dim d_head kv_channels dim_head attention_head_size swa_head_dim index_head_dim "
      "indexer_head_dim linear_head_dim linear_key_head_dim linear_value_head_dim mamba_d_head mamba_head_dim "
      "mamba_headdim qk_head_dim v_head_dim query_pre_attn_scalar d_rel", HEAD_DIM, fill=HEAD_DIM)
_rule("qk_rope_head_dim qk_nope_head_dim", HEAD_DIM // 2)
_rule("rotary_dim", _at_most(HEAD_DIM // 2))
_rule("kv_lora_rank q_lora_rank o_lora_rank", RANK)
_rule("laurel_rank adapter_rank loop_gate_rank hc_lowrank gated_norm_rank", _at_most(8))
_rule("intermediate_size ffn_dim decoder_ffn_dim encoder_ffn_dim n_inner dff dim_ff ffn_hidden_size d_inner "
      "feed_forward_size intermediate_size_mlp dense_intermediate_size prefix_dense_intermediate_size", FFN)
_rule("moe_intermediate_size expert_ffn_hidden_size shared_expert_intermediate_size "
      "shared_experts_intermediate_size moe_shared_expert_intermediate_size shared_intermediate_size",
      _at_most(EXPERT_FFN))
_rule("hidden_size_per_layer_input ple_embed_dim router_hidden_size prompt_mid_dim pronunciation_embed_dim "
      "shape_embed_dim", _at_most(32))
_rule("vocab_size decoder_vocab_size unpadded_vocab_size vocab_size_per_layer_input", VOCAB)
_rule("pronunciation_vocab_size shape_vocab_size encoder_hash_byte_group_vocab num_centroids", _at_most(32))
_rule("num_experts num_local_experts n_routed_experts moe_num_experts", _at_most(EXPERTS), fill=EXPERTS)
_rule("num_experts_per_tok num_experts_per_token moe_k moe_topk top_k_experts centroid_intermediate_top_k",
      _at_most(TOP_K), fill=TOP_K)
_rule("n_shared_experts num_shared_experts moe_num_shared_experts first_k_dense_replace num_dense_layers "
      "moe_layer_start_index", _at_most(1))
_rule("n_group num_expert_group topk_group", _at_most(1), fill=1)
_rule("zero_expert_num", _at_most(2))
_rule("max_position_embeddings n_positions n_ctx max_seq_len max_target_positions context_length "
      "original_max_position_embeddings model_max_length", POSITIONS)
_rule("sliding_window attention_chunk_size sliding_window_size window_size local_attention "
      "local_attention_window_len attention_window_size keep_window_size chunk_size mamba_chunk_size block_size "
      "index_topk index_block_size rel_extent", lambda v: min(v, WINDOW) if v > 0 else v)
_rule("index_topk_blocks", _at_most(2))
_rule("mamba_d_state state_size ssm_state_size", _at_most(16))
_rule("mamba_expand expand", 1)
_rule("mamba_n_groups n_groups mamba_ngroups", _at_most(2))
_rule("mamba_dt_rank time_step_rank", 8)
_rule("mamba_d_conv conv_kernel conv1d_width conv_kernel_size linear_conv_kernel_dim short_conv_kernel_size "
      "ple_conv_kernel_size", _at_most(4))
# period / offset patterns: two layers show both kinds
_rule("attn_layer_period expert_layer_period global_attn_every_n_layers sliding_window_pattern "
      "_sliding_window_pattern no_rope_layer_interval layer_group_size", 2)
_rule("attn_layer_offset expert_layer_offset", 1)
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
              "forced_bos_token_id": 1, "forced_eos_token_id": 2, "sep_token_id": 3, "cls_token_id": 4,
              "eod_token_id": 2, "mask_token_id": 5, "unk_token_id": 3}


class NotBuildable(Exception):
    """The class cannot be built tiny on CPU or cannot run a text-only causal-LM forward."""


def causal_lm_classes() -> list[tuple[str, str]]:
    """``(model_type, class_name)`` of every causal-LM class, one model_type per class, sorted by class name.

    Where several model types map to one class, the one named like the class (its ``...TextConfig`` first,
    then its ``...Config``, then the type the config class itself declares) is kept."""
    by_class: dict[str, list[str]] = {}
    for model_type, name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        by_class.setdefault(name, []).append(model_type)

    def rank(name: str, model_type: str) -> tuple[int, int, str]:
        base = name
        for suffix in ("ForCausalLM", "LMHeadModel", "WithLMHead", "ForConditionalGeneration", "Decoder"):
            base = base.split(suffix)[0]
        config = CONFIG_MAPPING_NAMES.get(model_type, "").lower()
        by_name = {f"{base}textconfig".lower(): 0, f"{base}config".lower(): 1}.get(config, 2)
        try:
            declared = 0 if CONFIG_MAPPING[model_type].model_type == model_type else 1
        except Exception:
            declared = 1
        return by_name, declared, model_type

    return sorted(((min(types, key=lambda t: rank(name, t)), name) for name, types in by_class.items()),
                  key=lambda pair: pair[1])


def _is_index_list(key: str, value: Any, n: int) -> bool:
    return (isinstance(value, list) and bool(value) and any(s in key for s in ("layer", "idx", "ids", "indices"))
            and all(type(i) is int and 0 <= i < n for i in value) and value == sorted(set(value)))


def _keep_layers(d: dict[str, Any], n: int) -> list[int]:
    """The fewest layers (at least 2) that show every value of every per-layer list and index list."""
    features: list[set[tuple[str, Any]]] = [set() for _ in range(n)]
    for key, value in d.items():
        if _is_index_list(key, value, n):
            for i in range(n):
                features[i].add((key, i in value))
        elif isinstance(value, list) and len(value) == n and all(not isinstance(v, (list, dict)) for v in value):
            for i in range(n):
                features[i].add((key, value[i]))
    need = set().union(*features) if features else set()
    kept: list[int] = []
    while need:
        best = max(range(n), key=lambda i: (len(features[i] & need), -i))
        kept.append(best)
        need -= features[best]
    for i in range(n):
        if len(kept) >= 2:
            break
        if i not in kept:
            kept.append(i)
    return sorted(kept)


def _shrink_value(key: str, value: Any) -> Any:
    rule = _SIZES.get(key)
    if value is None:
        return _FILL.get(key)
    if rule is None or isinstance(value, bool):
        return value
    if isinstance(value, list):
        return [_shrink_value(key, v) for v in value]
    if not isinstance(value, (int, float)):
        return value
    return rule(value) if callable(rule) else rule


def _shrink_rope(rope: dict[str, Any], partial: float) -> dict[str, Any]:
    rope = dict(rope)
    partial = rope.get("partial_rotary_factor", partial) or 1.0
    half = max(1, int(HEAD_DIM * partial) // 2)
    if isinstance(rope.get("mrope_section"), list):  # the sections split the rotary half: keep proportions
        old = rope["mrope_section"]
        new = [max(0, round(s * half / sum(old))) for s in old]
        new[0] += half - sum(new)
        rope["mrope_section"] = new
    for key in ("short_factor", "long_factor"):
        if isinstance(rope.get(key), list):
            rope[key] = rope[key][:half]
    if "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = min(rope["original_max_position_embeddings"], POSITIONS)
    return rope


def _shrink(d: dict[str, Any]) -> dict[str, Any]:
    """The config dict ``d`` with every size-like key shrunk (see the module docstring)."""
    original, d = d, dict(d)
    n = next((d[k] for k in _LAYER_KEYS if type(d.get(k)) is int), None)
    if n is not None:
        kept = _keep_layers(d, n)
        for key, value in list(d.items()):
            if _is_index_list(key, value, n):
                d[key] = [j for j, i in enumerate(kept) if i in value]
            elif isinstance(value, list) and len(value) == n:
                d[key] = [value[i] for i in kept]
            elif key == "per_layer_config" and isinstance(value, dict):
                d[key] = {str(j): {k: _shrink_value(k, v) for k, v in value[str(i)].items()}
                          for j, i in enumerate(kept) if str(i) in value}
        for key in _LAYER_KEYS + ("encoder_layers", "num_encoder_layers"):
            if type(d.get(key)) is int:
                d[key] = len(kept) if d[key] == n else min(d[key], 2)
        if type(d.get("moe_layer_end_index")) is int and d["moe_layer_end_index"] >= 0:
            d["moe_layer_end_index"] = len(kept) - 1
    vocab = VOCAB if "vocab_size" in d else None
    for key, value in list(d.items()):
        if isinstance(value, dict) and "model_type" in value:
            d[key] = _shrink(value)
        elif key in ("rope_parameters", "rope_scaling") and isinstance(value, dict):
            partial = d.get("partial_rotary_factor") or 1.0
            nested = all(isinstance(v, dict) for v in value.values())
            d[key] = ({k: _shrink_rope(v, partial) for k, v in value.items()} if nested
                      else _shrink_rope(value, partial))
        elif any(s in key for s in ("dropout", "pdrop", "layerdrop", "jitter")) and isinstance(value, float):
            d[key] = 0.0
        elif key in _TOKEN_IDS and vocab is not None and value is not None:
            fix = lambda t: t if t < vocab else _TOKEN_IDS[key]  # noqa: E731
            d[key] = [fix(t) for t in value] if isinstance(value, list) else fix(value)
        elif key != "per_layer_config":
            d[key] = _shrink_value(key, value)
    if d.get("kv_lora_rank") and "qk_rope_head_dim" in d:  # MLA: the rotary part is the head_dim of rope
        if "head_dim" in d and original.get("head_dim") == original["qk_rope_head_dim"]:
            d["head_dim"] = d["qk_rope_head_dim"]
        if original.get("num_key_value_heads") == original.get("num_attention_heads"):
            d["num_key_value_heads"] = d["num_attention_heads"]
    if "use_cache" in d:
        d["use_cache"] = False
    if "is_decoder" in d:  # a causal LM: BERT-like classes attend bidirectionally otherwise
        d["is_decoder"] = True
    return d


def _reason(exc: BaseException) -> str:
    """A one-line reason from an exception: the missing module for import errors, else type + first line."""
    text = " ".join(str(exc).split())
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        return f"needs optional dependency {exc.name!r}"
    if isinstance(exc, ImportError) and (found := re.search(r"requires the (\S+) librar", text)):
        return f"needs optional dependency {found[1]!r}"
    if isinstance(exc, NotBuildable):
        return text
    return f"{type(exc).__name__}: {text[:160]}"


def _model_class(class_name: str) -> type:
    try:
        return getattr(transformers, class_name)
    except Exception as exc:  # a lazy import failing: usually a missing optional dependency
        cause = exc.__cause__ or exc
        raise NotBuildable(f"import failed: {_reason(cause)}") from exc


def tiny_config(model_type: str, class_name: str) -> transformers.PretrainedConfig:
    """The shrunk config of ``class_name`` (see the module docstring)."""
    cls = _model_class(class_name)
    config_cls = getattr(cls, "config_class", None) or CONFIG_MAPPING[model_type]
    try:
        default = config_cls()
    except Exception as exc:
        raise NotBuildable(f"default config invalid: {_reason(exc)}") from exc
    try:
        config = config_cls.from_dict(_shrink(default.to_dict()))
    except Exception as exc:
        raise NotBuildable(f"shrunk config rejected: {_reason(exc)}") from exc
    return config


def build_tiny(model_type: str, class_name: str, *, seed: int = 0, check: bool = True) -> torch.nn.Module:
    """A tiny fp32 ``class_name`` in train mode; ``check`` runs one no-grad forward on ``SEQ`` tokens first
    (random state kept) so that a class that cannot run text-only raises ``NotBuildable`` here."""
    cls = _model_class(class_name)
    config = tiny_config(model_type, class_name)
    attn = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    torch.manual_seed(seed)
    try:
        model = cls._from_config(config, dtype=torch.float32, attn_implementation=attn)
    except Exception as exc:
        raise NotBuildable(f"construction failed: {_reason(exc)}") from exc
    model = model.float().train()
    if check:
        with torch.random.fork_rng(), torch.no_grad():
            try:
                smoke(model, backward=False)
            except Exception as exc:
                raise NotBuildable(f"text-only forward failed: {_reason(exc)}") from exc
    return model


def forward_kwargs(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """``input_ids``, ``labels`` and, where ``forward`` names it, ``position_ids``."""
    kwargs = {"input_ids": input_ids, "labels": input_ids}
    if "position_ids" in inspect.signature(model.forward).parameters:
        kwargs["position_ids"] = torch.arange(input_ids.shape[1])[None]
    return kwargs


def smoke(model: torch.nn.Module, *, backward: bool = True, seed: int = 0) -> float:
    """One forward (+ backward) on ``[1, SEQ]`` random tokens; returns the loss."""
    input_ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    out = model(**forward_kwargs(model, input_ids))
    loss = out.loss if hasattr(out, "loss") else out[0]
    if loss is None or not torch.isfinite(loss):
        raise RuntimeError(f"loss is {loss}")
    if backward:
        loss.backward()
    return float(loss)


def main() -> int:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    rows, start = [], time.perf_counter()
    for model_type, class_name in causal_lm_classes():
        t = time.perf_counter()
        try:
            model = build_tiny(model_type, class_name, check=False)
            smoke(model)
            params = sum(p.numel() for p in model.parameters())
            verdict = "ok" if "position_ids" in forward_kwargs(model, torch.zeros(1, 1, dtype=torch.long)) \
                else "ok (no position_ids)"
        except Exception as exc:
            params, verdict = 0, f"not buildable: {_reason(exc)}"
        rows.append((class_name, model_type, verdict, params, time.perf_counter() - t))
        print(f"{class_name:42s} {model_type:26s} {params:>10,d} {rows[-1][4]:6.2f}s  {verdict}", flush=True)
    ok = sum(r[2].startswith("ok") for r in rows)
    print(f"\n{ok}/{len(rows)} ok, {time.perf_counter() - start:.1f}s total", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
