"""``attn_implementation="wallfacer"`` for HF transformers models, through the public extension point.

``register()`` adds ``wallfacer_attention_forward`` to ``transformers.AttentionInterface`` (idempotent; done on
import of ``ds_wallfacer.integration``). No mask function is registered on purpose: for an implementation
missing from ``AttentionMaskInterface``, transformers skips mask creation (``_preprocess_mask_arguments``), so
no [N, N] causal mask is ever materialised and zigzag position ids are not mistaken for packed sequences. The
causal structure comes from ``module.is_causal``; right padding needs no mask (padded positions come after
every real token and carry no label, ``data/loader.py``).

The function finds this rank's sequence-parallel attention on the attention module itself (``attach``), so
model code and classes stay untouched and there is no module-level state.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn

from . import positional
from .vision import runs_images

BATCH_KWARG = "wallfacer_batch"
"""The model-forward keyword carrying a packed batch's documents and chunk assignment (``packing.py``)."""

__all__ = ["ATTN_IMPLEMENTATION", "BATCH_KWARG", "attach", "attention_modules", "detach", "implementation", "model_attention", "off_text_path", "point_attention",
           "reference_implementation", "register", "set_implementation", "wallfacer_attention_forward"]

ATTN_IMPLEMENTATION = "wallfacer"
_ATTR = "_wallfacer_attention"
_SP_SIZE = "_wallfacer_sp_size"
_BEFORE = "_wallfacer_attn_before"


def wallfacer_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention function: q/k [B, h, S_l, d], v [B, hk, S_l, dv] (this rank's shard) -> ([B, S_l, hq, dv], None).
    ``s_aux`` (gpt-oss): per-head attention sink logits [hq], applied exactly (``attention/sinks.py``)."""
    attn = module.__dict__.get(_ATTR)
    if attn is None:
        raise RuntimeError(
            f'{type(module).__name__} uses attn_implementation="wallfacer" but has no sequence-parallel attention '
            "attached: build the engine with ds_wallfacer.integration.initialize(model=..., config=...)"
        )
    if attention_mask is not None:
        raise ValueError(
            "wallfacer attention got an explicit attention mask; only causal (or bidirectional) attention over "
            "right-padded sequences is supported: pass attention_mask to the sequence-parallel loader, not the model"
        )
    if dropout:
        raise ValueError(f"attention dropout ({dropout}) is not supported by wallfacer attention; set it to 0")
    _check_kwargs(module, kwargs)
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    full = query.shape[2] * module.__dict__[_SP_SIZE]
    if window is not None:
        if int(window) < 1:
            raise ValueError(f"{type(module).__name__}: sliding_window = {window} is invalid: give a positive window "
                             "or null for full attention")
        if not causal:
            raise ValueError(f"{type(module).__name__}: a sliding window on bidirectional attention is not supported")
        if int(window) >= full:  # every key of the sequence is inside the window: plain causal attention, as in HF
            window = None
    batch = kwargs.get(BATCH_KWARG)
    chunk = positional.chunk_size(module)
    # chunks as documents of their own (Note [Chunked attention and position-scaled queries])
    if chunk is not None and chunk < full:
        batch = positional.with_chunks(batch, chunk=chunk, seq_len=full, rows=query.shape[0])
    query = positional.position_scaled(module, query, kwargs.get(positional.POSITIONS_KWARG))
    sinks = kwargs.get("s_aux")
    if sinks is not None and tuple(sinks.shape) != (query.shape[1],):
        raise ValueError(f"{type(module).__name__}: s_aux of shape {tuple(sinks.shape)} is not one attention sink per "
                         f"query head ({query.shape[1]}): not supported yet")
    out = attn(query, key, value, causal=causal, scale=scaling, batch=batch,
               window=None if window is None else int(window), softcap=float(kwargs.get("softcap") or 0.0),
               sinks=sinks)
    # [B, hq, S_l, dv]
    return out.transpose(1, 2).contiguous(), None


_PASSED_THROUGH = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states", "return_dict",
    "past_key_values", "past_key_value", "cache", "layer_idx", "position_embeddings", "logits_to_keep",
})
"""Keyword arguments transformers forwards to every attention call that do not change what attention computes
(positions reach attention through q and k; there is no cache in training)."""
_APPLIED = frozenset({"sliding_window", "softcap", "s_aux", BATCH_KWARG, "wallfacer_positions"})
"""Keyword arguments sequence-parallel attention applies."""


def _check_kwargs(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Refuse an argument that changes attention and that the sequence-parallel kernels would ignore (e.g. varlen
    boundaries passed by hand): dropping it would be silent."""
    for key, value in kwargs.items():
        if key in _PASSED_THROUGH or key in _APPLIED or value is None or value is False:
            continue
        if key.startswith(("output_", "return_")):  # what the model returns (router logits, ...), not attention
            continue
        raise ValueError(
            f"{type(module).__name__} passes {key!r} to the attention function, which wallfacer attention does not "
            f"apply, so the result would differ from the model's own attention: not supported yet"
        )


def off_text_path(model: nn.Module) -> set[int]:
    """Modules a text-only batch never runs: outside the language model (``get_decoder()``), its input embeddings
    and its LM head, e.g. the vision or audio tower of a multimodal model. The sequence-parallel loader passes only
    token ids, positions and labels; images go through the vision tower whole, on every rank (``vision.py``), so
    these never see a shard."""
    try:
        decoder = model.get_decoder()
    except (AttributeError, NotImplementedError, ValueError):
        return set()
    if decoder is None or decoder is model:
        return set()
    used = {id(m) for m in decoder.modules()}
    for extra in (model.get_input_embeddings(), model.get_output_embeddings()):
        if extra is not None:
            used |= {id(m) for m in extra.modules()}
    around = {id(m) for m in model.modules() if any(x is decoder for x in m.modules())}  # the decoder's ancestors
    return {id(m) for m in model.modules() if id(m) not in used and id(m) not in around}


def set_implementation(model: nn.Module, impl: str) -> None:
    """``model.set_attn_implementation(impl)``; for a vision-language model whose vision tower runs on full images
    under sequence parallelism (``vision.runs_images``), on its text model only: the tower keeps its own attention."""
    model.set_attn_implementation({"text_config": impl} if runs_images(model) else impl)


def implementation(model: nn.Module) -> str | None:
    """The attn_implementation of the model's text model (``set_implementation``'s counterpart)."""
    from ..hf_config import text_config

    return getattr(text_config(model), "_attn_implementation", None)


def reference_implementation(model: nn.Module) -> str:
    """The attn_implementation the model had before ``attach`` (what the self-check compares against)."""
    return model.__dict__.get(_BEFORE, "sdpa")


@contextlib.contextmanager
def model_attention(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model`` (an HF model, or a wrapper such as PEFT's with ``get_base_model``) attends with
    the implementation it had before ``attach``, over whole local sequences: what generation needs (a KV cache,
    left-padded prompts, one token at a time), where nothing is sharded. Sequence-parallel attention after it."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if implementation(base) != ATTN_IMPLEMENTATION:
        yield
        return
    before = base.__dict__.get(_BEFORE) or model.__dict__.get(_BEFORE) or "sdpa"  # as reference_implementation
    set_implementation(base, before)
    try:
        yield
    finally:
        set_implementation(base, ATTN_IMPLEMENTATION)


def register() -> None:
    """Make ``attn_implementation="wallfacer"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, wallfacer_attention_forward)


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules that call the attention interface: HF attention layers (they carry ``is_causal``,
    ``scaling`` and the model ``config``)."""
    return [
        (n, m) for n, m in model.named_modules()
        if hasattr(m, "is_causal") and hasattr(m, "scaling") and hasattr(m, "config")
    ]


def attach(model: nn.Module, attention: Any, *, sp_size: int) -> list[str]:
    """Give every attention layer of ``model`` this rank's sequence-parallel attention; switch the model to
    ``attn_implementation="wallfacer"``. Returns the layer names."""
    register()
    mods = attention_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__}: found no attention layers (modules with is_causal/scaling/config)")
    before = implementation(model)
    if before != ATTN_IMPLEMENTATION:
        model.__dict__[_BEFORE] = before or "eager"
        set_implementation(model, ATTN_IMPLEMENTATION)
    point_attention([m for _, m in mods], attention, sp_size=sp_size)
    return [n for n, _ in mods]


def point_attention(modules: list[nn.Module], attention: Any, *, sp_size: int) -> None:
    """Give the attention ``modules`` (``attention_modules``, already attached) this sequence-parallel attention over
    ``sp_size`` ranks: how dynamic sequence parallelism switches group size between forwards."""
    for m in modules:
        # plain attributes (not sub-modules): no parameters, no state_dict entries
        m.__dict__[_ATTR] = attention
        m.__dict__[_SP_SIZE] = sp_size


def detach(model: nn.Module) -> None:
    """Remove what ``attach`` set (the attn_implementation stays)."""
    for _, m in attention_modules(model):
        m.__dict__.pop(_ATTR, None)
        m.__dict__.pop(_SP_SIZE, None)
