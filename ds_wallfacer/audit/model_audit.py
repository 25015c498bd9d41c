"""Start-up audit: refuse, before any collective, whatever the package would compute differently from the model.

``audit_model`` walks the model's config and module tree (pure checks: identical on every rank) and returns what
the loss module must reproduce (the MoE router aux loss, the rotary modules that read the sequence length). Each
refusal names the setting to change.

Design: Note [Start-up audit] and Note [Deny by default] in docs/design/audit.md (what is refused).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..hf_config import text_config
from ..adapters.moe import RouterAuxLoss, router_aux_loss
from ..adapters.rope import rope_problems
from .sequence_rules import sequence_findings

__all__ = ["ModelAudit", "RefusedModel", "audit_model", "audit_sequence", "reentrant_checkpointing", "refusal"]

_DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
_SOFTCAP_KEYS = ("attn_logit_softcapping",)


@dataclass
class ModelAudit:
    """What the audit found that the loss module must reproduce."""

    router_aux: RouterAuxLoss | None = None
    """The model's router aux loss (None: it adds none)."""
    rotary: list[str] = field(default_factory=list)
    """Rotary modules that read the sequence length (to be shown the global length)."""


def _kernel_lacks(kernel: str, *, mask: bool, softcap: bool) -> str | None:
    """What a kernel chosen by name cannot do for this model ("auto" picks one that can)."""
    if kernel == "auto":
        return None
    from ..attention.kernels import KERNELS

    k = KERNELS[kernel]()
    if softcap and not k.supports_softcap:
        able = [n for n, c in KERNELS.items() if c.supports_softcap]
        return f"attention logit soft-capping, which kernel {kernel!r} cannot apply (kernels that can: {able})"
    if mask and not k.supports_mask:
        able = [n for n, c in KERNELS.items() if c.supports_mask]
        return f"sliding-window attention, which kernel {kernel!r} cannot mask (kernels that can: {able})"
    return None


def _attention_problems(model: nn.Module, text: Any, seq_len: int | None, kernel: str) -> list[str]:
    out = []
    for key in _DROPOUT_KEYS:
        v = getattr(text, key, None)
        if isinstance(v, (int, float)) and v > 0:
            out.append(f"attention dropout {key}={v} is not supported by sequence-parallel attention: set {key}=0.0")
    softcap = any(getattr(text, key, None) for key in _SOFTCAP_KEYS)
    from ..adapters.hf import attention_modules

    # Qwen2 / Gemma layers carry their own window (None on full-attention layers); Mistral / Mixtral read the config
    windows = {
        m.sliding_window if hasattr(m, "sliding_window") else getattr(m.config, "sliding_window", None)
        for _, m in attention_modules(model)
    } - {None}
    windowed = bool(windows) and (seq_len is None or min(windows) < seq_len)
    lacks = _kernel_lacks(kernel, mask=windowed, softcap=softcap)
    if lacks is not None:
        out.append(f"the model uses {lacks}: set \"wallfacer\": {{\"kernel\": \"auto\"}}")
    return out


def reentrant_checkpointing(model: nn.Module) -> bool:
    """Whether transformers' own layer checkpointing is on and reentrant."""
    # transformers installs functools.partial(checkpoint, **kwargs) on each checkpointed layer
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if getattr(m, "gradient_checkpointing", False) and isinstance(fn, functools.partial):
            if fn.keywords.get("use_reentrant"):
                return True
    return False


def _moe_problems(model: nn.Module, mini_sequence: Any) -> tuple[RouterAuxLoss | None, list[str]]:
    spec, why = router_aux_loss(model)
    if why is not None:
        return None, [
            f"{type(model).__name__} adds a router auxiliary loss this package cannot reproduce ({why}): set "
            "output_router_logits=False in the model config to train without it"
        ]
    problems = []
    if spec is not None and reentrant_checkpointing(model):
        problems.append(
            "the MoE router aux loss needs the router logits' gradient, which reentrant activation checkpointing "
            "drops: call model.activation_checkpointing_enable(activation_checkpointing_kwargs="
            "{\"use_reentrant\": False}) (transformers' default) instead"
        )
    if spec is not None and mini_sequence is not None and mini_sequence.activation_checkpointing == "deepspeed":
        problems.append(
            "the MoE router aux loss needs the router logits' gradient, which DeepSpeed's (reentrant) layer "
            'checkpointing drops: set "wallfacer": {"mini_sequence": {"activation_checkpointing": "torch"}} (or "none")'
        )
    return spec, problems


def _lm_head_problems(model: nn.Module, mini_sequence: Any) -> list[str]:
    if mini_sequence is None or not mini_sequence.lm_head:
        return []
    from ..mst.lm_head import head_transform

    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return [f'{type(model).__name__}\'s LM head is {type(head).__name__}, not nn.Linear: set "wallfacer": '
                '{"mini_sequence": {"lm_head": false}}']
    try:
        head_transform(model)
    except NotImplementedError as err:
        return [f'{err}: set "wallfacer": {{"mini_sequence": {{"lm_head": false}}}}']
    return []


class RefusedModel(ValueError):
    """The model cannot be trained exactly as configured; the message lists every problem and what to change."""


def refusal(model: nn.Module, detail: str) -> RefusedModel:
    """The one refusal text: ``<Model> cannot be trained exactly with ds_wallfacer as configured:<detail>``."""
    return RefusedModel(f"{type(model).__name__} cannot be trained exactly with ds_wallfacer as configured:{detail}")


def _refuse(model: nn.Module, problems: list[str]) -> None:
    if problems:
        raise refusal(model, "".join(f"\n  - {p}" for p in problems))


def _sequence_problems(model: nn.Module, seq_len: int | None, allow_modules: tuple[str, ...]) -> list[str]:
    from ..adapters.hf import attention_modules

    return [f.message() for f in sequence_findings(
        model, text=text_config(model), seq_len=seq_len, allow=allow_modules,
        attention=[m for _, m in attention_modules(model)])]


def audit_sequence(model: nn.Module, *, seq_len: int | None = None, allow_modules: tuple[str, ...] = ()) -> None:
    """Deny by default (``sequence_rules.py``): raise ``RefusedModel`` listing every module that could mix tokens
    outside the attention function, before anything reads the model's sizes. ``allow_modules``: class names exempt
    from the rules (``wallfacer.allow_modules``)."""
    _refuse(model, _sequence_problems(model, seq_len, allow_modules))


def audit_model(
    model: nn.Module, *, mini_sequence: Any = None, seq_len: int | None = None, kernel: str = "auto",
    allow_modules: tuple[str, ...] = (), sequence: bool = True,
) -> ModelAudit:
    """Check ``model`` for what sequence parallelism / MsT would compute differently; raise ``RefusedModel`` listing
    every problem with the setting to change, else return what the loss module must reproduce. ``sequence=False``
    leaves out the deny-by-default rules (``audit_sequence``, for a caller that ran them first)."""
    text = text_config(model)
    problems = _sequence_problems(model, seq_len, allow_modules) if sequence else []
    problems += _attention_problems(model, text, seq_len, kernel)
    spec, moe = _moe_problems(model, mini_sequence)
    problems += moe
    wrap, rope = rope_problems(model)
    problems += rope
    problems += _lm_head_problems(model, mini_sequence)
    _refuse(model, problems)
    return ModelAudit(router_aux=spec, rotary=wrap)
