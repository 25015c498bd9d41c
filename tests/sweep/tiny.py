"""Tiny instances of every causal-LM class of the installed transformers, built from config (no downloads).

Shrinking rule, the same for every model: take the config class's defaults, serialize them to a dict and
rewrite each size-like key found there by its name (``_SIZES``): hidden 64; 4 attention heads and 2 kv heads
of dim 16 (MLA: one kv head per head where the full model has that, rope / nope dims 8, ranks 32); MLP 128;
vocab 128 (bos / eos / pad ids moved below it); 4 experts, top-2, expert MLP 32; mamba / SSM /
linear-attention mixers of 4 heads x 16 (expand 1, state 16, conv kernel <= 4); windows, attention chunks and
SSM chunks of 16 tokens; 512 positions.  Defaults of None that the models cannot take (``head_dim``, kv heads,
expert counts) get the tiny value.  The layers kept are the fewest (2, up to 4) that still show every kind of
layer of the full model: per-layer lists (``layer_types``, ``mlp_layer_types``, ...), layer-index lists
(``mlp_only_layers``, ``full_attn_idxs``, ...), repeated type patterns and the segments of layer counts
(``first_k_dense_replace``, ``num_kv_shared_layers``, loop ranges) are cut to a greedy cover of their values
(``_keep_layers``); period / offset patterns are set so that 2 layers show both kinds.  Nested configs
(``text_config``, ``vision_config``, ...) are shrunk by the same rules.  Dropout-like values (keys with
``dropout``, ``pdrop``, ``layerdrop``, ``jitter``) are 0, ``use_cache`` is False, decoder / causal flags are
set (``is_decoder``, ``causal``, ``attn_type``), ``tie_word_embeddings`` stays the default.  The config is
rebuilt from the dict, so its own ``__post_init__`` derives and validates the rest, and the model is built
right after ``torch.manual_seed(seed)``, in fp32 and train mode, with sdpa attention where the class has it.
The only per-model entries are ``_DEFAULT_PATCHES`` (defaults no model can be built from) and
``_NOT_TEXT_ONLY`` (why a class cannot be a text-only causal LM).

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

__all__ = ["NotBuildable", "causal_lm_classes", "tiny_config", "build_tiny", "forward_kwargs", "smoke", "is_causal",
           "SEQ", "VOCAB"]

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 64, 4, 2, 16, 128, 128
EXPERTS, TOP_K, EXPERT_FFN, RANK, WINDOW, POSITIONS, SEQ = 4, 2, 32, 32, 16, 512, 64
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "num_decoder_layers",
               "num_blocks", "num_layers_per_stack")

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
      "word_embed_proj_dim lru_width backbone_hidden_size mamba_d_ssm hidden_size_global output_channels "
      "ext_pw_out_channel depthwise_separable_out_channel nemo_conv_channels", HIDDEN)
_rule("num_attention_heads n_head n_heads num_heads attention_heads decoder_attention_heads encoder_attention_heads "
      "num_decoder_attention_heads num_encoder_attention_heads swa_num_attention_heads index_n_heads "
      "linear_num_heads mamba_n_heads mamba_num_heads n_mamba_heads "
      "num_attention_heads_per_layer", HEADS, fill=HEADS)
_rule("num_key_value_heads num_kv_heads swa_num_key_value_heads num_query_groups", KV_HEADS, fill=KV_HEADS)
# linear attention scans whole heads per rank (head-parallel): key and value heads both divide by the 4 ranks, and
# two value heads share each key head, as in every released gated delta-net
_rule("linear_num_key_heads", HEADS, fill=HEADS)
_rule("linear_num_value_heads", 2 * HEADS, fill=2 * HEADS)
_rule("head_dim attention_head_dim d_head kv_channels dim_head attention_head_size swa_head_dim index_head_dim "
      "linear_head_dim linear_key_head_dim linear_value_head_dim mamba_d_head mamba_head_dim "
      "mamba_headdim qk_head_dim query_pre_attn_scalar d_rel", HEAD_DIM, fill=HEAD_DIM)
# MLA's value heads are narrower than its query/key heads in every released model (DeepSeek-V3: 128 vs 128 + 64):
# keep them unequal (8 vs nope 8 + rope 8), the property sequence parallelism must handle
_rule("v_head_dim", HEAD_DIM // 2, fill=HEAD_DIM)
_rule("indexer_n_heads", HEADS)  # optional (None: no indexer), like the two below
_rule("indexer_kv_heads", _at_most(KV_HEADS))
_rule("indexer_head_dim", HEAD_DIM)
_rule("indexer_compress_ratio", _at_most(4))
_rule("qk_rope_head_dim qk_nope_head_dim", HEAD_DIM // 2)
_rule("rotary_dim", _at_most(HEAD_DIM // 2))
_rule("kv_lora_rank q_lora_rank o_lora_rank", RANK)
_rule("laurel_rank adapter_rank loop_gate_rank hc_lowrank gated_norm_rank", _at_most(8))
_rule("intermediate_size ffn_dim decoder_ffn_dim encoder_ffn_dim n_inner dff dim_ff ffn_hidden_size d_inner "
      "feed_forward_size intermediate_size_mlp dense_intermediate_size prefix_dense_intermediate_size mlp_dim", FFN)
_rule("block_multiple_of", _at_most(16))
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
_rule("n_shared_experts num_shared_experts moe_num_shared_experts", _at_most(1), fill=1)
_rule("n_group num_expert_group topk_group", _at_most(1), fill=1)
_rule("zero_expert_num", _at_most(2))
_rule("max_position_embeddings n_positions n_ctx max_seq_len max_target_positions context_length "
      "original_max_position_embeddings model_max_length", POSITIONS)
_rule("sliding_window attention_chunk_size sliding_window_size window_size local_attention "
      "local_attention_window_len attention_window_size keep_window_size chunk_size mamba_chunk_size block_size "
      "index_topk index_block_size indexer_budget rel_extent local_attn_chunk_length lsh_attn_chunk_length",
      lambda v: min(v, WINDOW) if v > 0 else v)
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
_rule("n_layers_per_attn_res_block", 1)  # attention-residual blocks: loop bounds are multiples of it
_rule("hash_seed", lambda v: v, fill=0)  # reformer's LSH rotations: seeded, not drawn anew each forward
_TOKEN_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
              "forced_eos_token_id": 2, "sep_token_id": 3, "cls_token_id": 4, "eod_token_id": 2,
              "mask_token_id": 5}


# The only per-model entries.  Patches to the default config, applied before shrinking: defaults that no model
# can be built from (every released checkpoint sets these) ...
_DEFAULT_PATCHES: dict[str, dict[str, Any]] = {
    "dbrx": {"attn_config": {"rope_theta": 5e5, "clip_qkv": 8.0}},  # no rope_theta field; clamps with clip_qkv
    "lfm2_moe": {"num_hidden_layers": 24, "layer_types": ["conv", "conv", "full_attention"] * 8},  # default None
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e4}}},
    "qwen4_exp_text": {"indexer_n_heads": 16, "indexer_kv_heads": 1, "indexer_head_dim": 128,  # its default
                       "indexer_budget": 2048, "indexer_compress_ratio": 4},  # "indexed_attention" layers need them
    # ... and defaults of all-mamba stacks, where the released checkpoints interleave attention layers
    "bamba": {"attn_layer_indices": [9, 18, 27]},
    "lfm2": {"layer_types": ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
             "num_hidden_layers": 16},  # LFM2-1.2B's pattern (the default is all attention)
    "granitemoehybrid": {"layer_types": (["linear_attention"] * 5 + ["full_attention"]) * 5 + ["linear_attention"] * 2},
}
# Classes whose forward cannot be a text-only causal LM on input_ids (the exception would not say why):
_NOT_TEXT_ONLY: dict[str, str] = {
    "GitForCausalLM": "its loss always skips the image-patch positions: needs pixel_values",
    "MusicgenForCausalLM": "audio-code LM: labels are [batch, seq, num_codebooks]",
    "MusicgenMelodyForCausalLM": "audio-code LM: labels are [batch, seq, num_codebooks]",
    "Gemma4AssistantForCausalLM": "speculative drafter: runs on the target model's embeddings and kv cache",
    "Gemma4UnifiedAssistantForCausalLM": "speculative drafter: runs on the target model's embeddings and kv cache",
}


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

    return sorted(((min(types, key=lambda t: rank(name, t)) if len(types) > 1 else types[0], name)
                   for name, types in by_class.items()), key=lambda pair: pair[1])


# Layer counts that cut the stack into segments: the first k layers (dense MLP, input block), the last k
# (output block, layers reusing an earlier layer's kv cache); the count of the middle is derived.
_HEAD_COUNTS = ("first_k_dense_replace", "num_dense_layers", "n_input_layers", "moe_layer_start_index")
_TAIL_COUNTS = ("n_output_layers", "num_kv_shared_layers")
_MID_COUNTS = ("n_recurrent_layers",)
_RANGES = (("loop_layer_index_start", "loop_layer_index_end"),)  # [start, end): layers run more than once
_PER_TYPE_COUNTS = ("num_kv_shared_layers",)  # a layer reuses the cache of one of its own type: keep each type


def _is_index_list(key: str, value: Any, n: int) -> bool:
    """Sorted layer indices (``mlp_only_layers``, ``full_attn_idxs``, ``global_attn_indexes``, ...)."""
    return (isinstance(value, list) and bool(value) and re.search("layer|idx|ids|indices|indexes", key) is not None
            and all(type(i) is int and 0 <= i < n for i in value) and value == sorted(set(value)))


def _segment(d: dict[str, Any], n: int, i: int) -> tuple[bool, ...]:
    heads = tuple(i < d[k] for k in _HEAD_COUNTS if type(d.get(k)) is int)
    tails = tuple(i >= n - d[k] for k in _TAIL_COUNTS if type(d.get(k)) is int)
    return heads + tails + tuple(x for a, b in _RANGES if type(d.get(a)) is int for x in (i < d[a], i >= d[b]))


def _cycled(key: str, value: Any, n: int) -> bool:
    """A pattern of layer types shorter than the stack, repeated over it (recurrent_gemma's block_types)."""
    return "type" in key and isinstance(value, list) and 0 < len(value) < n and all(type(v) is str for v in value)


def _keep_layers(d: dict[str, Any], n: int, per_kind: int = 1) -> list[int]:
    """The fewest layers (at least 2) that show ``per_kind`` times every value of every per-layer list, every
    membership of every layer-index list and every segment of the layer counts (greedy cover)."""
    features: list[set[tuple[str, Any]]] = [{("segment", _segment(d, n, i))} for i in range(n)]
    types = d.get("layer_types") if isinstance(d.get("layer_types"), list) else [None] * n
    for key in _PER_TYPE_COUNTS:
        if type(d.get(key)) is int:
            for i in range(n):
                features[i].add((key, i >= n - d[key], types[i] if len(types) == n else None))
    for key, value in d.items():
        if _is_index_list(key, value, n):
            for i in range(n):
                features[i].add((key, i in value))
        elif isinstance(value, list) and len(value) == n and all(not isinstance(v, (list, dict)) for v in value):
            for i in range(n):
                features[i].add((key, value[i]))
        elif _cycled(key, value, n):
            for i in range(n):
                features[i].add((key, value[i % len(value)]))
    need = {f: min(per_kind, sum(f in fs for fs in features)) for fs in features for f in fs}
    kept: list[int] = []
    while any(need.values()):
        best = max((i for i in range(n) if i not in kept),
                   key=lambda i: (sum(need[f] > 0 for f in features[i]), -i))
        kept.append(best)
        for f in features[best]:
            need[f] = max(0, need[f] - 1)
    kept += [i for i in range(n) if i not in kept][: max(0, 2 - len(kept))]
    return sorted(kept)


def _cut_layers(d: dict[str, Any], n: int, kept: list[int]) -> None:
    """Cut every per-layer value of ``d`` (lists, index lists, per-layer overrides, counts) to ``kept``."""
    segments = [_segment(d, n, i) for i in kept]
    for key, value in list(d.items()):
        if _is_index_list(key, value, n):
            d[key] = [j for j, i in enumerate(kept) if i in value]
        elif isinstance(value, list) and len(value) == n:
            d[key] = [value[i] for i in kept]
        elif _cycled(key, value, n):
            d[key] = [value[i % len(value)] for i in kept]
        elif key == "per_layer_config" and isinstance(value, dict):
            by_index = {int(k): v for k, v in value.items()}
            d[key] = {str(j): _tie_heads(by_index[i], {k: _shrink_value(k, v) for k, v in by_index[i].items()},
                                         mla=True)
                      for j, i in enumerate(kept) if i in by_index}
    for key in _LAYER_KEYS + ("encoder_layers", "num_encoder_layers"):
        if type(d.get(key)) is int:
            d[key] = len(kept) if d[key] == n else min(d[key], 2)
    counted = [k for k in _HEAD_COUNTS + _TAIL_COUNTS if type(d.get(k)) is int]
    for c, key in enumerate(counted):
        d[key] = sum(s[c] for s in segments)
    for key in _MID_COUNTS:
        if type(d.get(key)) is int:
            d[key] = sum(not any(s) for s in segments)
    for start, end in _RANGES:
        if type(d.get(start)) is int:
            d[start], d[end] = (sum(i < d[start] for i in kept), sum(i < d[end] for i in kept))
    if type(d.get("moe_layer_end_index")) is int and d["moe_layer_end_index"] >= 0:
        d["moe_layer_end_index"] = len(kept) - 1


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


def _tie_heads(original: dict[str, Any], d: dict[str, Any], *, mla: bool) -> dict[str, Any]:
    """MLA keeps one kv head per query head where the full model does, and rope on ``qk_rope_head_dim``
    where that is the full model's ``head_dim``."""
    if mla and "head_dim" in d and original.get("head_dim") == original.get("qk_rope_head_dim"):
        d["head_dim"] = d["qk_rope_head_dim"]
    heads = original.get("num_attention_heads")
    if mla and "num_key_value_heads" in d and original["num_key_value_heads"] == heads:
        d["num_key_value_heads"] = d["num_attention_heads"]
    return d


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


def _shrink(d: dict[str, Any], per_kind: int = 1) -> dict[str, Any]:
    """The config dict ``d`` with every size-like key shrunk (see the module docstring)."""
    original, d = d, dict(d)
    n = next((d[k] for k in _LAYER_KEYS if type(d.get(k)) is int), None)
    if n is not None:
        _cut_layers(d, n, _keep_layers(d, n, per_kind))
    vocab = VOCAB if "vocab_size" in d else None
    for key, value in list(d.items()):
        if isinstance(value, dict) and "model_type" in value:
            d[key] = _shrink(value, per_kind)
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
    _tie_heads(original, d, mla="kv_lora_rank" in d)
    hidden = next((original[k] for k in ("hidden_size", "d_model", "n_embd") if type(original.get(k)) is int), None)
    if hidden and type(d.get("attention_hidden_size")) is int:  # a multiple of hidden (zamba: 2x, rwkv: 1x)
        d["attention_hidden_size"] = max(1, d["attention_hidden_size"] * HIDDEN // hidden)
    if isinstance(d.get("axial_pos_shape"), list):  # factorized positions: the product is the trained length
        d["axial_pos_shape"] = [8, SEQ // 8]
        dims = d["axial_pos_embds_dim"]
        d["axial_pos_embds_dim"] = [HIDDEN * dims[0] // sum(dims), HIDDEN - HIDDEN * dims[0] // sum(dims)]
    if d.get("default_language") is None and d.get("languages"):  # per-language adapters: pick the first
        d["default_language"] = d["languages"][0]
    if "use_cache" in d:
        d["use_cache"] = False
    for key, both_ways, causal in (("is_decoder", False, True), ("causal", False, True), ("attn_type", "bi", "uni")):
        if d.get(key) == both_ways:  # a causal LM: BERT-likes, XLM and XLNet attend both ways otherwise
            d[key] = causal
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


def _as_dict(config: transformers.PretrainedConfig) -> dict[str, Any]:
    """``config.to_dict()``, with the layer counts and per-layer lists as the model reads them (a ``to_dict``
    may rewrite those in a checkpoint's layout: dory's doubles its layers into attention + mlp blocks)."""
    d = config.to_dict()
    attrs = vars(config)
    for key, value in d.items():
        attr = attrs.get(key)
        if type(attr) is type(value) and attr != value and (
                type(value) is int or (isinstance(value, list) and all(isinstance(v, str) for v in value))):
            d[key] = attr
    return d


def _merge(d: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    return {**d, **{k: _merge(d.get(k) or {}, v) if isinstance(v, dict) and k != "rope_parameters" else v
                    for k, v in patch.items()}}


def tiny_config(model_type: str, class_name: str, *, per_kind: int = 1,
                adjust: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> transformers.PretrainedConfig:
    """The shrunk config of ``class_name``, with ``per_kind`` layers of each kind (see the module docstring);
    ``adjust``: a last change to the shrunk dict (the multimodal sweep's tiny images, ``tiny_multimodal.py``, which
    builds the classes that cannot run text alone too)."""
    if class_name in _NOT_TEXT_ONLY and adjust is None:
        raise NotBuildable(_NOT_TEXT_ONLY[class_name])
    cls = _model_class(class_name)
    config_cls = getattr(cls, "config_class", None) or CONFIG_MAPPING[model_type]
    try:
        default = config_cls()
    except Exception as exc:
        raise NotBuildable(f"default config invalid: {_reason(exc)}") from exc
    d = _merge(_as_dict(default), _DEFAULT_PATCHES.get(default.model_type, {}))
    try:
        shrunk = _shrink(d, per_kind)
        return config_cls.from_dict(adjust(shrunk) if adjust is not None else shrunk)
    except Exception as exc:
        raise NotBuildable(f"shrunk config rejected: {_reason(exc)}") from exc


def build_tiny(model_type: str, class_name: str, *, seed: int = 0, check: bool = True,
               adjust: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> torch.nn.Module:
    """A tiny fp32 ``class_name`` in train mode, weights from ``torch.manual_seed(seed)``.

    The fewest layers that show each kind of layer once are tried first, two of each kind if that fails (zamba
    ties one shared block across its hybrid layers), then eager attention (Apertus 1.5's image tokenizer has no
    sdpa).  ``check`` runs one no-grad forward on ``SEQ`` tokens
    (random state kept) so that a class that cannot run a text-only forward raises ``NotBuildable`` here."""
    cls = _model_class(class_name)
    attn = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    tries = [(1, attn), (2, attn)] + ([(1, "eager")] if attn != "eager" else [])  # a sub-model without sdpa
    for i, (per_kind, impl) in enumerate(tries):
        config = tiny_config(model_type, class_name, per_kind=per_kind, adjust=adjust)
        torch.manual_seed(seed)
        try:
            model = cls._from_config(config, dtype=torch.float32, attn_implementation=impl).float().train()
            break
        except Exception as exc:
            if i == len(tries) - 1:
                raise NotBuildable(f"construction failed: {_reason(exc)}") from exc
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
    return float(loss.detach())


def is_causal(model: torch.nn.Module) -> bool:
    """Whether the logits before position ``SEQ // 2`` ignore the token there (random state kept)."""
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[0, SEQ // 2] = (ids[0, SEQ // 2] + 1) % VOCAB
    logits = []
    for x in (ids, other):
        kwargs = forward_kwargs(model, x)
        kwargs.pop("labels")
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(0)
            logits.append(model(**kwargs).logits[:, : SEQ // 2])
    return torch.allclose(logits[0], logits[1], rtol=0, atol=1e-6)


def main() -> int:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    rows, start, classes = [], time.perf_counter(), causal_lm_classes()
    width = max(len(name) for _, name in classes)
    print(f"{'class':{width}s} {'model_type':26s} {'params':>10s} {'seconds':>7s}  verdict", flush=True)
    for model_type, class_name in classes:
        t = time.perf_counter()
        try:
            model = build_tiny(model_type, class_name, check=False)
            smoke(model)
            params = sum(p.numel() for p in model.parameters())
            notes = [] if "position_ids" in forward_kwargs(model, torch.zeros(1, 1, dtype=torch.long)) \
                else ["no position_ids"]
            notes += [] if is_causal(model) else ["not causal"]
            verdict = f"ok ({', '.join(notes)})" if notes else "ok"
        except Exception as exc:
            params, verdict = 0, f"not buildable: {_reason(exc)}"
        rows.append((class_name, model_type, verdict, params, time.perf_counter() - t))
        print(f"{class_name:{width}s} {model_type:26s} {params:>10,d} {rows[-1][4]:7.2f}  {verdict}", flush=True)
    ok = sum(r[2].startswith("ok") for r in rows)
    print(f"\n{ok}/{len(rows)} ok, {time.perf_counter() - start:.1f}s total", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
