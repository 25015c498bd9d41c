"""Recognising the placeholder pattern of a vision-language model from its own code (reads classes and sources,
runs nothing).

Most vision-language classes of transformers merge images into the text the same way: the tower and projector
compute one feature row per placeholder token (``get_image_features``, ``get_video_features``), the placeholder
tokens are found by their id (``get_placeholder_mask``), ``masked_scatter`` writes the rows into the token
embeddings, and the language model runs on those embeddings with the text's own 1-D positions. A model has the
pattern when the forward that merges (the model's, or its inner ``model``'s) does exactly that and nothing else:
deny by default, as the mixer layers are recognised (``mixer_layers.py``). Every call of that forward is read
(``ast``) and must be one of the pattern's steps or a harmless conversion (``_HARMLESS``); anything else is refused,
named, with what it does where we know it (``_KNOWN``: its own 3-D positions, its own attention masks, audio, ...).
The language model must get the merged embeddings and the given positions, and the logits must be the LM head of
its hidden states (what the loss module computes from ``inputs_embeds``).

Design: Note [One adapter for the placeholder pattern] in docs/design/documents.md.
"""
from __future__ import annotations

import ast
import inspect
import re
import textwrap
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from torch import nn

from ..hf_config import backbone
from .type_spans import MASK_CALLS, TypeSpans, type_spans

__all__ = ["MediaKind", "PlaceholderForm", "placeholder_form"]


@dataclass(frozen=True)
class MediaKind:
    """One kind of media the forward merges: its features method and its placeholder token."""

    name: str
    """"image" or "video"."""
    method: str
    """The merging module's features method (``get_image_features``)."""
    token_id: int
    """The placeholder token's id (``config.image_token_id``)."""


@dataclass(frozen=True)
class PlaceholderForm:
    """Where a model with the placeholder pattern merges, and what."""

    merger: str
    """The attribute path of the module whose forward merges ("" the model itself, "model" its inner model)."""
    kinds: tuple[MediaKind, ...]
    field: str
    """The features methods' output the forward scatters (``pooler_output``; Fuyu's ``last_hidden_state``)."""
    type_spans: TypeSpans | None = None
    """How its ``token_type_ids`` become bidirectional spans (Gemma 3, PaliGemma: ``type_spans.py``); None when its
    forward builds no masks."""


_TEXT_MODELS = ("language_model", "text_model")
_TEXT_KEYWORDS = frozenset({"inputs_embeds", "position_ids", "attention_mask", "cache", "past_key_values",
                            "use_cache", "cache_position", "output_attentions", "output_hidden_states", "return_dict",
                            "logits_to_keep"})
"""Keywords the forward may pass the language model: the merged embeddings, the positions, and what training does
not use (a cache) or the loss module passes itself."""
_HARMLESS = re.compile(
    r"(ValueError|TypeError|isinstance|len|self\.loss_function|torch\.cat|torch\.tensor|torch_compilable_check|DynamicCache|"
    r"logger\.warning(_once)?|\w*Output\w*|self(\.(language_model|text_model))?\.get_input_embeddings(\(\))?|"
    r"input_ids\.clone|[\w.\[\]()]+\.(to|flatten|reshape|view|size|contiguous|unsqueeze|masked_scatter|get))$")
"""Calls that convert, check or build outputs: none changes what the language model computes (``input_ids.clone``:
a copy whose placeholders are set to a constant before embedding, ``_read``)."""
_KNOWN = (
    (re.compile(r"compute_3d_position_ids|get_rope_index"),
     "it numbers its tokens with 3-D (M-RoPE) positions computed from the images"),
    (re.compile(r"create_\w*mask\w*|get_block_sequence_ids_for_mask|create_masks_for_\w+"),
     "it builds attention masks of its own beside other steps (or from more than token_type_ids), which "
     "sequence-parallel attention does not apply (Gemma 3's and PaliGemma's, from token_type_ids alone, it does)"),
    (re.compile(r"get_audio_\w+|embed_audio"), "it merges audio as well, which ds_wallfacer does not place on shards"),
    (re.compile(r"get_per_layer_inputs"), "its language model takes per-layer inputs computed from the token ids"),
)
_OUTPUT_DICTS = frozenset({"mm_encoder_outputs", "kwargs"})
"""Dicts the forward fills: the towers' outputs (returned beside the logits), the keywords it passes on."""
_HEAD_SCALES = frozenset({"logit_scale", "logits_scaling", "output_multiplier", "final_logit_softcapping"})
"""What ``mst.lm_head.HeadTransform`` applies after the LM head (the loss module applies it too)."""
_PLACEHOLDER_IDS = frozenset({"image_token_id", "image_token_index", "video_token_id", "video_token_index"})
"""The config attributes a placeholder mask may compare the token ids with."""
_DEFAULT_POSITIONS = re.compile(r"(torch\.arange|cache\.get_seq_length|[\w.]+\.(unsqueeze|expand|view|to))$")
"""Calls that fill default 1-D positions (``if position_ids is None: position_ids = arange(...)``): the positions
the loader gives, per document."""


@lru_cache(maxsize=None)
def _source_tree(fn: Any) -> ast.FunctionDef | None:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return None
    node = tree.body[0] if tree.body else None
    return node if isinstance(node, ast.FunctionDef) else None


def _name(node: ast.AST) -> str:
    """``self.model.get_input_embeddings()`` -> "self.model.get_input_embeddings()"; "?" for other expressions."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return f"{_name(node.func)}()"
    if isinstance(node, ast.Subscript):
        return f"{_name(node.value)}[]"
    return "?"


def _defaults_positions(node: ast.AST) -> bool:
    """``if position_ids is None:`` (the block that fills the model's own default positions)."""
    t = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(t, ast.Compare) and _name(t.left) == "position_ids"
            and len(t.ops) == 1 and isinstance(t.ops[0], ast.Is) and isinstance(t.comparators[0], ast.Constant)
            and t.comparators[0].value is None)


def _walk(fn: ast.FunctionDef) -> list[tuple[ast.AST, bool]]:
    """(node, inside an ``if position_ids is None:`` block) for the nodes of ``fn``'s body (decorators aside)."""
    out: list[tuple[ast.AST, bool]] = []
    todo: list[tuple[ast.AST, bool]] = [(n, False) for n in fn.body]
    while todo:
        node, defaults = todo.pop()
        out.append((node, defaults))
        if _defaults_positions(node):
            todo += [(n, True) for n in node.body] + [(n, defaults) for n in node.orelse]
        else:
            todo += [(n, defaults) for n in ast.iter_child_nodes(node)]
    return out


@dataclass
class _Reading:
    """What one forward does, read from its code."""

    calls: list[tuple[str, ast.Call]]
    """Every call outside the default-positions block."""
    default_calls: list[str]
    """The calls inside it."""
    in_place: list[str]
    position_writes: int
    shifted: bool = False
    """Whether its default positions add a constant (PaliGemma numbers from 1, ``past_seen_tokens`` aside)."""


def _placeholders_blanked(node: ast.AST, clones: set[str]) -> bool:
    """``ids[mask] = 0`` on a copy of ``input_ids`` (Kimi-K2.5 embeds its placeholders as token 0; the scatter
    replaces those rows, and their embedding gets no gradient either way)."""
    return (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Subscript)
            and _name(node.targets[0].value) in clones and isinstance(node.value, ast.Constant))


def _read(fn: ast.FunctionDef) -> _Reading:
    walked = _walk(fn)
    nodes = [n for n, _ in walked]
    calls = [(_name(n.func), n) for n, d in walked if isinstance(n, ast.Call) and not d]
    default_calls = [_name(n.func) for n, d in walked if isinstance(n, ast.Call) and d]
    clones = {t.id for n in nodes if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call)
              and _name(n.value.func) == "input_ids.clone" for t in n.targets if isinstance(t, ast.Name)}
    in_place = [_name(t.value) for n in nodes if isinstance(n, (ast.Assign, ast.AugAssign))
                and not _placeholders_blanked(n, clones)
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                if isinstance(t, ast.Subscript) and _name(t.value) not in _OUTPUT_DICTS]
    writes = sum(1 for n, d in walked if isinstance(n, ast.Assign) and not d
                 for t in n.targets if isinstance(t, ast.Name) and t.id == "position_ids")
    shifted = any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Add, ast.Sub)) and any(
        isinstance(x, ast.Constant) and x.value for x in (n.left, n.right)) for n, d in walked if d)
    return _Reading(calls, default_calls, in_place, writes, shifted)


def _token_refs(module: nn.Module, helpers: list[str], forward: ast.FunctionDef) -> list[str]:
    """What the placeholder methods compare ``input_ids`` with (``self.config.image_token_id``), then the
    ``self.config.<x>_token_...`` the forward hands them (MiniCPM-V passes the id as an argument)."""
    refs = []
    for name in helpers:
        fn = _source_tree(getattr(type(module), name, None))
        refs += [_name(n.comparators[0]) for n in ast.walk(fn) if fn is not None and isinstance(n, ast.Compare)
                 and _name(n.left) == "input_ids" and len(n.comparators) == 1 and isinstance(n.ops[0], ast.Eq)]
    helper_calls = {f"self.{h}" for h in helpers}
    refs += [_name(a) for n in ast.walk(forward) if isinstance(n, ast.Call) and _name(n.func) in helper_calls
             for a in n.args if _name(a).startswith("self.config.")]
    return refs


def _token_ids(module: nn.Module, refs: list[str]) -> dict[str, int]:
    """{"image": id, "video": id} from the references ``_token_refs`` found (``..._token_id``/``_index``)."""
    found: dict[str, int] = {}
    for ref in refs:
        attr = ref.rsplit(".", 1)[-1]
        owner = module.config if ref.startswith("self.config.") else module if ref.startswith("self.") else None
        value = getattr(owner, attr, None) if owner is not None else None
        for kind in ("image", "video"):
            if kind in attr and isinstance(value, int):
                found.setdefault(kind, int(value))
    return found


def _merging(model: nn.Module) -> tuple[str, nn.Module] | None:
    for path in ("", "model"):
        m = getattr(model, path, None) if path else model
        fn = _source_tree(getattr(type(m), "forward", None)) if isinstance(m, nn.Module) else None
        if fn is not None and any(n == "self.get_image_features" for n, _ in _read(fn).calls):
            return path, m
    return None


def _helpers(module: nn.Module, reading: _Reading) -> list[str]:
    """The module's own methods the forward calls that find the placeholders and scatter the rows into the
    embeddings (``get_placeholder_mask``; Idefics' ``inputs_merger``)."""
    out = []
    for name, _ in reading.calls:
        attr = name[len("self."):] if name.startswith("self.") else ""
        fn = _source_tree(getattr(type(module), attr, None)) if attr and "." not in attr else None
        if fn is None or attr.startswith("get_") and attr.endswith("_features"):
            continue
        if any(isinstance(n, ast.Compare) and _name(n.left) == "input_ids" for n in ast.walk(fn)):
            out.append(attr)
    return out


def _odd_calls(reading: _Reading, helpers: list[str], kinds: list[str]) -> list[str]:
    allowed = {f"self.{h}" for h in helpers} | {f"self.get_{k}_features" for k in kinds}
    allowed |= {f"self.{t}" for t in _TEXT_MODELS}
    odd = {n for n, _ in reading.calls if n not in allowed and not _HARMLESS.match(n)}
    odd |= {n for n in reading.default_calls if not _DEFAULT_POSITIONS.match(n) and not _HARMLESS.match(n)}
    return sorted(odd)


def _text_call(module: nn.Module, reading: _Reading) -> tuple[str, ast.Call] | str:
    calls = [(n[len("self."):], c) for n, c in reading.calls if n in {f"self.{t}" for t in _TEXT_MODELS}]
    if len(calls) != 1:
        return "its forward does not call its language model exactly once"
    attr, call = calls[0]
    kws = {k.arg for k in call.keywords if k.arg is not None
           and not (isinstance(k.value, ast.Constant) and k.value.value is None)}
    odd = sorted(kws - _TEXT_KEYWORDS)
    if odd:
        return f"it passes its language model {', '.join(odd)} beside the merged embeddings"
    given = {k.arg: _name(k.value) for k in call.keywords if k.arg is not None}
    if given.get("inputs_embeds") != "inputs_embeds" or given.get("position_ids", "position_ids") != "position_ids":
        return "its language model does not run on the merged embeddings with the given positions"
    return attr, call


def _head_step(v: ast.AST) -> bool:
    """One step of ``logits = ...``: the LM head, the language model's logits, or a step of ``HeadTransform``
    (``logits * ...logit_scale``, ``logits / ...logits_scaling``, soft-capping by ``final_logit_softcapping``)."""
    if isinstance(v, ast.Call):
        return _name(v.func) == "self.lm_head" or (_name(v.func) == "torch.tanh" and _name(v.args[0]) == "logits")
    if isinstance(v, ast.BinOp) and isinstance(v.op, (ast.Mult, ast.Div)) and (
            _name(v.left) == "logits" or (isinstance(v.left, ast.Call) and _name(v.left.func) == "self.lm_head")):
        return _name(v.right).rsplit(".", 1)[-1] in _HEAD_SCALES
    return _name(v) in ("outputs[]", "outputs.logits")


def _plain_head(cls: type) -> bool:
    """Whether ``cls.forward``'s logits are its LM head's output, changed only as ``HeadTransform`` describes."""
    fn = _source_tree(getattr(cls, "forward", None))
    if fn is None:
        return False
    values = [n.value for n in ast.walk(fn) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and t.id == "logits"]
    return bool(values) and all(_head_step(v) for v in values)


def _check_head(model: nn.Module, merger: nn.Module, text: nn.Module) -> str | None:
    """Why the loss module's logits (the decoder's hidden states through ``get_output_embeddings``) would differ
    from the model's; None when they agree."""
    try:
        decoder, head = backbone(model), model.get_output_embeddings()
    except (AttributeError, NotImplementedError, ValueError):
        return "its decoder or LM head cannot be found"
    if decoder is not text and decoder is not getattr(text, "model", None):
        return "its decoder is not the language model its forward runs"
    owners = [type(model)] + ([type(text)] if merger is model else [])
    if head is None or not all(_plain_head(c) for c in owners):
        return "its logits are more than its LM head's output (changed after the head in a way not known here)"
    from ..mst.lm_head import head_transform

    try:
        head_transform(model)
    except NotImplementedError as err:
        return str(err)
    return None


def _refusal(odd: list[str]) -> str:
    known = [why for pattern, why in _KNOWN if any(pattern.search(n) for n in odd)]
    named = ", ".join(odd[:6]) + (f" and {len(odd) - 6} more" if len(odd) > 6 else "")
    return "; ".join(known) if known else f"its forward does more than the placeholder pattern (it calls {named})"


def placeholder_form(model: nn.Module) -> PlaceholderForm | str:
    """The model's placeholder pattern, or why it does not have it (a sentence naming what its forward does)."""
    found = _merging(model)
    if found is None:
        return "its forward does not compute image features with get_image_features"
    path, merger = found
    fn = _source_tree(type(merger).forward)
    assert fn is not None
    reading = _read(fn)
    methods = sorted({n[len("self.get_"):-len("_features")] for n, _ in reading.calls
                      if re.fullmatch(r"self\.get_\w+_features", n)})
    helpers = _helpers(merger, reading)
    odd = _odd_calls(reading, helpers, [k for k in methods if k in ("image", "video")])
    masks = all(MASK_CALLS.match(n) for n in odd) and any(re.search(r"create_\w*mask|block_sequence", n) for n in odd)
    if odd and not masks:
        return _refusal(odd)
    in_place = [v for v in reading.in_place if not (masks and v == "mask_kwargs")]  # PaliGemma's block ids
    if in_place:
        return f"its forward writes into {', '.join(sorted(set(in_place)))} in place"
    if reading.position_writes:
        return "its forward computes position ids of its own"
    if not any(n.endswith(".masked_scatter") for n, _ in reading.calls) and not helpers:
        return "its forward does not scatter the features into the embeddings"
    text = _text_call(merger, reading)
    if isinstance(text, str):
        return text
    if reading.shifted and any(isinstance(m, nn.Embedding) and "position" in n
                               for n, m in getattr(merger, text[0]).named_modules()):
        return ("its default positions are shifted by a constant (the loader's start at 0 in each document) and its "
                "language model embeds absolute positions")
    why = _check_head(model, merger, getattr(merger, text[0]))
    if why is not None:
        return why
    refs = _token_refs(merger, helpers, fn)
    other = sorted({r.rsplit(".", 1)[-1] for r in refs} - _PLACEHOLDER_IDS - {"token_id"})
    if other:
        return (f"it tells its placeholders apart by more than their ids (it compares the tokens with "
                f"{', '.join(other)})")
    ids = _token_ids(merger, refs)
    missing = [k for k in methods if k not in ids]
    if missing:
        return f"its {' and '.join(missing)} placeholder token ids are not read from its config"
    fields = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)} & {"pooler_output", "last_hidden_state"}
    if len(fields) != 1:
        return "its forward does not read one output field of its features methods"
    spans = type_spans(model, merger, fn, text[0]) if masks else None
    if isinstance(spans, str):
        return spans
    kinds = tuple(MediaKind(k, f"get_{k}_features", ids[k]) for k in methods)
    return PlaceholderForm(merger=path, kinds=kinds, field=fields.pop(), type_spans=spans)
