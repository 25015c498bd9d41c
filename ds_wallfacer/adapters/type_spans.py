"""Bidirectional attention a vision-language model builds from its token types (Gemma 3's images, PaliGemma's
prefix), recognised from its code and measured on its own mask builders, turned into the attention's bidirectional
spans per document.

Gemma 3 and PaliGemma have the placeholder pattern plus one thing: their forward turns ``token_type_ids`` into
attention masks in which some tokens see each other both ways. Sequence-parallel attention never reads a mask; it
takes causal attention plus spans (Note [Bidirectional spans] in docs/design/spans.md), so such a model is
accepted when (1) the forward's extra calls are mask builders only and ``token_type_ids`` goes nowhere but into
them (read with ``ast``; anything else stays refused by ``placeholder_forms``), and (2) the masks it builds equal
causal attention plus the spans ``data.packing.type_runs`` derives, on every layer type: the forward is run up to
its language model on probe rows of token types (a pre-hook stops it there: no parameter is read) with a small
window and the eager masks, and each layer type's mask is compared with the rule. Gemma 3's sliding layers are
AND(window, OR(causal, span)), the rule itself; PaliGemma 2's OR the span onto the sliding causal mask (a span is
visible whole), which agrees with the rule only while no span is longer than the window: such a span is refused at
batch time (``TypeSpans.spans``). Gemma 4 (bidirectional on sliding layers only) measures as neither.

Design: Note [Spans from token types] in docs/design/spans.md.
"""
from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..data.packing import type_runs

__all__ = ["MASK_CALLS", "TypeSpans", "type_spans"]

MASK_CALLS = re.compile(r"(create_causal_mask|create_sliding_window_causal_mask|create_masks_for_generate|"
                        r"create_masks_for_vision_model|get_block_sequence_ids_for_mask|torch\.where|getattr|"
                        r"mask_kwargs\.copy|self\.config\.get_text_config)$")
"""The calls a forward may make beside the placeholder pattern to build its masks from the token types."""
_KEY = "token_type_ids"
_PROBE_WINDOW = 3
_PROBE_TYPES = ((0, 1, 1, 1, 1, 1, 0, 0, 1, 1, 0, 0), (0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1))
"""Two rows: two images (runs of 1, one longer than the probe window) in text; a prefix of 5 (runs of 0) before a
suffix. Each candidate reading is compared on the rows it can express."""
_CANDIDATES = ((1, False), (0, True))
"""(type value, one block per row): Gemma 3's runs of image tokens, PaliGemma's prefix."""


class _Stop(Exception):
    """Raised by the pre-hook on the language model: the masks are built, the rest is not run."""


@dataclass(frozen=True)
class TypeSpans:
    """How a model's ``token_type_ids`` become bidirectional spans."""

    model: str
    """The model's class name (for messages)."""
    value: int
    """The token type whose runs attend both ways (1: Gemma 3's image tokens, 0: PaliGemma's prefix)."""
    single: bool
    """All of a row's tokens of that type are one block (PaliGemma): one run per document, more refused."""
    whole_window: int | None
    """The window of layers that see a span whole (PaliGemma 2's sliding layers): a longer span is refused."""
    key: str = _KEY
    """The batch key of the token types."""

    def spans(self, types: Any, *, starts: Sequence[Sequence[int]],
              real_lengths: Sequence[int]) -> list[list[tuple[int, int]]]:
        """Per row, the spans of ``types`` [B, N] inside each document (``starts``: its documents' starts; tokens at
        and after ``real_lengths[b]`` are padding), checked against the window where spans are seen whole."""
        t = torch.as_tensor(types).long()
        t = t.unsqueeze(0) if t.dim() == 1 else t
        keep = torch.arange(t.shape[1])[None] < torch.tensor(list(real_lengths))[:, None]
        out = type_runs(torch.where(keep, t, -1), self.value, starts=starts, single=self.single)
        for r, row in enumerate(out):
            long = [b - a for a, b in row if self.whole_window is not None and b - a > self.whole_window]
            if long:
                raise ValueError(
                    f"{self.model}: row {r} has a bidirectional span of {long[0]} tokens (token_type_ids == "
                    f"{self.value}) longer than its sliding window of {self.whole_window}: its sliding layers see "
                    "such a span whole, which sequence-parallel attention (the window cuts the keys before a query) "
                    f"does not compute; keep each prefix within {self.whole_window} tokens")
        return out


def _uses_of_types(fn: ast.FunctionDef) -> bool:
    """Whether ``token_type_ids`` is read only in ``if`` tests and in the block-id calls (``torch.where``,
    ``get_block_sequence_ids_for_mask``): it changes the masks and nothing else."""
    parents = {c: p for p in ast.walk(fn) for c in ast.iter_child_nodes(p)}
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Name) and node.id == _KEY and isinstance(node.ctx, ast.Load)):
            continue
        up, ok = node, False
        while up in parents and not ok:
            child, up = up, parents[up]
            ok = (isinstance(up, (ast.If, ast.IfExp)) and child is up.test) or (
                isinstance(up, ast.Call) and MASK_CALLS.match(_callee(up)) is not None and child in up.args)
        if not ok:
            return False
    return True


def _callee(call: ast.Call) -> str:
    f = call.func
    parts = []
    while isinstance(f, ast.Attribute):
        parts.append(f.attr)
        f = f.value
    return ".".join([f.id if isinstance(f, ast.Name) else "?", *reversed(parts)])


def _allowed(mask: torch.Tensor | None, n: int) -> torch.Tensor:
    """[B, n, n] bool (query, key) from a mask builder's output (eager: 0 where allowed; None: causal)."""
    if mask is None:
        return torch.ones(n, n, dtype=torch.bool).tril()[None]
    m = mask[:, 0] if mask.dim() == 4 else mask
    return m if m.dtype == torch.bool else m == 0


def _rule(spans: Sequence[tuple[int, int]], n: int, window: int | None, whole: bool) -> torch.Tensor:
    """[n, n] bool: causal, windowed (``window``), plus the spans: cut by the window (the attention's rule) or
    seen whole (``whole``)."""
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]
    near = (i - j < window) if window is not None else torch.ones(n, n, dtype=torch.bool)
    both = torch.zeros(n, n, dtype=torch.bool)
    for a, b in spans:
        both[a:b, a:b] = True
    return (near & ((j <= i) | both)) | (both if whole else torch.zeros_like(both))


def _measured(merger: nn.Module, text: str) -> dict[str, torch.Tensor] | str:
    """{layer type: [B, n, n] allowed pairs} of the masks the forward hands its language model (``text``) for
    ``_PROBE_TYPES``, built eagerly with a probe window; or why they could not be measured."""
    cfg = copy.deepcopy(merger.config)
    tc = cfg.get_text_config()
    tc._attn_implementation = "eager"
    if getattr(tc, "sliding_window", None) is not None:
        tc.sliding_window = _PROBE_WINDOW
    types = torch.tensor(_PROBE_TYPES)
    b, n = types.shape
    seen: dict[str, Any] = {}

    def stop(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        seen["mask"] = kwargs.get("attention_mask")
        raise _Stop

    hook = getattr(merger, text).register_forward_pre_hook(stop, with_kwargs=True, prepend=True)
    saved = merger.config
    try:
        merger.config = cfg
        merger.forward(inputs_embeds=torch.zeros(b, n, int(tc.hidden_size)), token_type_ids=types,
                       position_ids=torch.arange(n).expand(b, n), use_cache=False)
    except _Stop:
        pass
    except Exception as err:  # noqa: BLE001 - any failure is a refusal with its reason
        return f"its masks from token_type_ids could not be measured ({type(err).__name__}: {err})"
    finally:
        merger.config = saved
        hook.remove()
    mask = seen.get("mask")
    if isinstance(mask, dict):
        return {k: _allowed(v, n) for k, v in mask.items()}
    return {"full_attention": _allowed(mask, n)} if mask is None or isinstance(mask, torch.Tensor) else \
        "its language model's attention_mask is not a mask built from token_type_ids"


def _reading(masks: dict[str, torch.Tensor], windowed: bool) -> tuple[int, bool, bool] | None:
    """(value, single, whole) of the candidate reading every layer type's mask agrees with, or None."""
    for value, single in _CANDIDATES:
        for whole in (False, True):
            ok, tried = True, 0
            for r, row in enumerate(_PROBE_TYPES):
                try:
                    spans = type_runs(torch.tensor([row]), value, single=single)[0]
                except ValueError:
                    continue  # this reading cannot express the row (PaliGemma's prefix in two runs)
                tried += 1
                for kind, got in masks.items():
                    window = _PROBE_WINDOW if kind == "sliding_attention" and windowed else None
                    ok &= bool(torch.equal(got[r], _rule(spans, len(row), window, whole and window is not None)))
            if ok and tried and (not whole or windowed):
                return value, single, whole
    return None


def type_spans(model: nn.Module, merger: nn.Module, forward: ast.FunctionDef, text: str) -> TypeSpans | str:
    """How ``merger``'s forward (``forward``, its code) turns ``token_type_ids`` into bidirectional attention, or
    why that is not causal attention plus spans. ``text``: the attribute of its language model."""
    import inspect

    name = type(model).__name__
    if _KEY not in inspect.signature(merger.forward).parameters or not _uses_of_types(forward):
        return "it builds attention masks of its own from more than token_type_ids, or uses token_type_ids otherwise"
    masks = _measured(merger, text)
    if isinstance(masks, str):
        return masks
    odd = sorted(set(masks) - {"full_attention", "sliding_attention"})
    if odd:
        return f"its language model takes masks for layer types {odd}, which spans do not describe"
    tc = merger.config.get_text_config()
    windowed = getattr(tc, "sliding_window", None) is not None
    found = _reading(masks, windowed)
    if found is None:
        return ("its attention masks from token_type_ids are not causal attention plus bidirectional spans on every "
                f"layer type ({', '.join(sorted(masks))}; e.g. bidirectional on sliding layers only)")
    value, single, whole = found
    return TypeSpans(name, value, single, int(tc.sliding_window) if whole else None)
