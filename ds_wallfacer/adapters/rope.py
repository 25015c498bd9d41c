"""Rotary embeddings that read the sequence length (``dynamic``, ``longrope``), made exact under sequence
parallelism: ``GlobalLengthRotary`` shows such a module the whole sequence's length during the loss module's
forward, where a rank's own position ids would give its shard's. Every other RoPE type is exact with global
position ids already.

Design: Note [Rotary embeddings that read the length] in docs/design/documents.md.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

__all__ = ["GlobalLengthRotary", "POSITION_DEPENDENT", "RopeLength", "is_rotary", "rope_problems", "rotary_modules",
           "wrap_rotary"]

POSITION_DEPENDENT = ("dynamic", "longrope")
"""Types whose frequencies transformers chooses from ``max(position_ids) + 1`` (any type containing "dynamic")."""


def _reads_length(rope_type: str) -> bool:
    # the same rule as transformers' dynamic_rope_update wrapper
    return "dynamic" in rope_type or rope_type == "longrope"


def _types(module: nn.Module) -> list[str]:
    t = module.rope_type
    return sorted(set(t.values())) if isinstance(t, dict) else [str(t)]


def _hf_wrapper_code() -> Any:
    from transformers.modeling_rope_utils import dynamic_rope_update

    return dynamic_rope_update(lambda self, x, position_ids: None).__code__


def rotary_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """HF rotary-embedding modules: they carry ``rope_type`` and an ``inv_freq`` buffer (one per layer type, e.g.
    ``sliding_attention_inv_freq``, in models whose layer types differ in RoPE). Not those off the text path (a
    vision tower's, which runs on whole images: ``hf.off_text_path``)."""
    from .hf import off_text_path

    off = off_text_path(model)
    return [(n, m) for n, m in model.named_modules() if is_rotary(m) and id(m) not in off]


def is_rotary(module: nn.Module) -> bool:
    """Whether ``module`` is an HF rotary embedding (``rotary_modules``)."""
    return hasattr(module, "rope_type") and (
        hasattr(module, "inv_freq") or any(n.endswith("inv_freq") for n, _ in module.named_buffers(recurse=False)))


def rope_problems(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names of rotary modules to wrap, reasons to refuse) for ``model``; pure, identical on every rank."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # + HunYuan's "ntk_alpha": named apart from "dynamic" by the model precisely because it does not read the length
    known = {"default", "ntk_alpha", *ROPE_INIT_FUNCTIONS}
    code = _hf_wrapper_code()
    wrap, problems = [], []
    for name, mod in rotary_modules(model):
        types = _types(mod)
        unknown = [t for t in types if t not in known]
        if unknown:
            problems.append(
                f"{name}: rope_type {unknown} is not one transformers' RoPE helpers define (known: {sorted(known)}); "
                "whether it reads the sequence length cannot be checked: use one of the known types"
            )
            continue
        if not any(_reads_length(t) for t in types):
            continue
        if getattr(type(mod).forward, "__code__", None) is not code:
            problems.append(
                f"{name} ({type(mod).__name__}): rope_type {types} reads the sequence length but its forward is not "
                "transformers' dynamic_rope_update, so it cannot be given the global length: set "
                'rope_parameters.rope_type to a fixed type ("default", "linear", "yarn", "llama3")'
            )
            continue
        wrap.append(name)
    return wrap, problems


class RopeLength:
    """The global sequence length for the current forward (None outside the loss module's forward)."""

    def __init__(self) -> None:
        self.length: int | None = None

    @contextlib.contextmanager
    def use(self, length: int) -> Iterator[None]:
        self.length = int(length)
        try:
            yield
        finally:
            self.length = None


class GlobalLengthRotary:
    """Instance ``forward`` of a length-reading rotary module: the model's forward, shown the global length."""

    def __init__(self, orig: Callable, state: RopeLength) -> None:
        self.orig = orig
        self.state = state

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        n = self.state.length
        if n is None:
            return self.orig(x, position_ids, *args, **kwargs)
        pos = position_ids.clamp(max=n - 1)  # [B, S_l]; only padding positions can exceed n - 1
        last = pos.new_full((*pos.shape[:-1], 1), n - 1)
        out = self.orig(x, torch.cat([pos, last], dim=-1), *args, **kwargs)  # max + 1 = n, as in one process
        s = position_ids.shape[-1]
        if not isinstance(out, tuple) or not all(isinstance(t, torch.Tensor) and t.shape[-2] == s + 1 for t in out):
            raise RuntimeError(f"rotary embedding returned {type(out).__name__}, expected (cos, sin) [B, S, dim]")
        return tuple(t[..., :s, :] for t in out)


def wrap_rotary(model: nn.Module, names: list[str], state: RopeLength) -> None:
    """Give each named rotary module a ``GlobalLengthRotary`` forward (idempotent)."""
    for name in names:
        mod = model.get_submodule(name)
        current = mod.__dict__.get("forward")
        if isinstance(current, GlobalLengthRotary):
            current.state = state  # wrapped by an earlier initialize: follow the newest loss module
        else:
            mod.forward = GlobalLengthRotary(mod.forward, state)
