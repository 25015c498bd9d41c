"""Deny by default: what in a model could mix tokens along the sequence other than the attention we replace.

Every module of the model is classified by what it is built from, never by the model's name: a fixed set of
``torch.nn`` blocks is position-wise (``_POSITIONWISE``); attention layers pass only when the kernels reproduce
them; every other class outside torch has its source read for calls that move information along the sequence
(``_SEQUENCE_OPS``). Pure: reads classes, sources and configs; identical on every rank. What passes is still
checked numerically by the start-up self-check (``self_check.py``).

Design: Note [Deny by default] in docs/design/audit.md (the rules, class by class).
"""
from __future__ import annotations

import inspect
import io
import re
import tokenize
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterable

from torch import nn
from torch.nn.modules import activation, conv, dropout, normalization, padding, pooling, rnn

from ..adapters import positional
from ..adapters.hf import off_text_path
from ..adapters.mixer_layers import mixer_layers, near_misses
from .peft_rules import peft_findings

__all__ = ["Finding", "sequence_findings"]

NOT_YET = "not supported yet: train this model without sequence parallelism, or leave this module out"

_POSITIONWISE = (
    nn.Linear, nn.Bilinear, nn.Embedding, nn.EmbeddingBag, nn.LayerNorm, nn.RMSNorm, nn.Identity,
    nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict,
    dropout._DropoutNd,
)
"""torch.nn classes whose output at a position depends on that position's input alone (containers included)."""

_SEQUENCE_TORCH: tuple[tuple[type, str], ...] = (
    (rnn.RNNBase, "a recurrent layer (state carried from token to token)"),
    (activation.MultiheadAttention, "attention computed by torch.nn.MultiheadAttention, not through transformers' "
                                    "attention interface"),
    (pooling._AvgPoolNd, "pooling across neighbouring tokens"),
    (pooling._MaxPoolNd, "pooling across neighbouring tokens"),
    (pooling._AdaptiveAvgPoolNd, "pooling across tokens"),
    (pooling._AdaptiveMaxPoolNd, "pooling across tokens"),
    (padding._ConstantPadNd, "padding that shifts tokens along the sequence"),
    (padding._ReflectionPadNd, "padding that shifts tokens along the sequence"),
    (padding._ReplicationPadNd, "padding that shifts tokens along the sequence"),
    (nn.modules.batchnorm._NormBase, "normalisation with statistics over several tokens"),
    (normalization.GroupNorm, "normalisation with statistics that may span tokens"),
    (normalization.LocalResponseNorm, "normalisation across neighbouring positions"),
)

_SEQUENCE_OPS = re.compile(
    r"\b(cumsum|cumprod|cummax|logcumsumexp|conv1d|conv2d|conv_transpose1d|causal_conv1d\w*|unfold|roll|flip|"
    r"tril|triu|arange|pad|\w*scan\w*|\w*delta_rule\w*|selective_state_update|segsum|lightning_attention\w*)\s*\("
)
"""Calls that can move information along the sequence dimension when they appear in a module's own code."""

_DISPATCH = re.compile(r"\b(ALL_ATTENTION_FUNCTIONS|_attn_implementation)\b")
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention", "global", "local",
                                    "full", "sliding", "chunked_attention"})
"""Values of ``config.layer_types`` that mean softmax attention (global, windowed, or within fixed chunks:
``positional.chunk_size``)."""
_POSITIONWISE_LAYER_TYPES = frozenset({"mlp", "moe"})
"""Values of ``config.layer_types`` for blocks without a sequence mixer (Nemotron-H's); their modules are still
classified one by one like every other."""


@dataclass(frozen=True)
class Finding:
    """One problem: where, what it is, what it does, what to do."""

    path: str
    """The first module with the problem (``model.layers.0.linear_attn``)."""
    cls: str
    """Its class name."""
    what: str
    """What it does that sequence parallelism would change."""
    fix: str
    """The setting to change, the mode that handles it, or "not supported yet"."""
    count: int = 1
    """Modules of the model with the same problem."""

    def message(self) -> str:
        more = f" (and {self.count - 1} more like it)" if self.count > 1 else ""
        return f"{self.path} ({self.cls}){more}: {self.what}: {self.fix}"


@lru_cache(maxsize=None)
def _code(cls: type) -> str:
    """The code ``cls`` runs: its source and that of its bases outside torch, without comments and docstrings."""
    return " ".join(_own_code(c) for c in cls.__mro__ if c is not object and not _is_torch(c))


@lru_cache(maxsize=None)
def _own_code(cls: type) -> str:
    """The source of ``cls`` itself (not its bases) without comments and docstrings; "" if unavailable."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return ""
    out, prev = [], tokenize.INDENT
    try:
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type == tokenize.COMMENT:
                continue
            if tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT):
                prev = tok.type
                continue  # a docstring
            if tok.type not in (tokenize.NL,):
                prev = tok.type
            out.append(tok.string)
    except (tokenize.TokenError, IndentationError):
        return src
    return " ".join(out)


@lru_cache(maxsize=None)
def _sequence_ops(cls: type) -> tuple[str, ...]:
    """The sequence ops ``cls``'s code calls (once per class, not per module of a model)."""
    return tuple(sorted({m.group(1) for m in _SEQUENCE_OPS.finditer(_code(cls))}))


def _is_torch(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "torch"


def _torch_problem(m: nn.Module) -> str | None:
    if isinstance(m, conv._ConvNd):
        k, p = tuple(m.kernel_size), tuple(m.padding) if not isinstance(m.padding, str) else m.padding
        if all(x == 1 for x in k) and (p == "valid" or all(x == 0 for x in p)):
            return None  # a 1x1 convolution is a linear layer per position
        return f"a convolution along the sequence (kernel_size {k})"
    if isinstance(m, dropout._DropoutNd):
        return None
    if isinstance(m, activation.Softmax) or isinstance(m, activation.LogSoftmax):
        return None if m.dim in (-1, None) else f"a softmax over dim {m.dim}, which may be the sequence"
    for base, what in _SEQUENCE_TORCH:
        if isinstance(m, base):
            return what
    if isinstance(m, _POSITIONWISE) or type(m).__module__ == activation.__name__:
        return None
    return f"a torch.nn module ({type(m).__module__}) not known to be position-wise"


def _dropout_problem(m: nn.Module) -> str | None:
    if isinstance(m, dropout._DropoutNd) and m.p > 0:
        return (f"dropout (p = {m.p}) draws its mask from each rank's own random stream, so sequence parallelism "
                "trains with other (and across shards repeated) masks than one device would")
    return None


_PASSES_SINKS = re.compile(r"\bs_aux\s*=\s*self\s*\.\s*sinks\b")
"""gpt-oss's call: the sink logits go to the attention function as ``s_aux``, which applies them exactly."""


def _applied_sinks(m: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Whether own parameter ``name`` is per-head attention sinks the attention function applies: one logit per
    query head, handed to it as ``s_aux=self.sinks`` (``attention/sinks.py``)."""
    heads = getattr(m, "num_heads", None) or getattr(getattr(m, "config", None), "num_attention_heads", None)
    return (name == "sinks" and param.dim() == 1 and heads is not None and param.shape[0] == int(heads)
            and bool(_PASSES_SINKS.search(_code(type(m)))))


def _attention_problems(m: nn.Module, text: Any, seq_len: int | None) -> list[tuple[str, str]]:
    """(what, fix) for one attention layer."""
    cls = type(m)
    out = []
    if not _DISPATCH.search(_code(cls)):
        out.append(("computes attention in its own code instead of calling transformers' attention interface, so "
                    "it would attend only to this rank's tokens", NOT_YET))
        return out
    own = [n for n, p in m.named_parameters(recurse=False) if not _applied_sinks(m, n, p)]
    if own:
        out.append((f"holds parameters of its own ({', '.join(own)}) that take part in attention beside q, k and v "
                    "(e.g. differential-attention lambdas or gates), which the sequence-parallel kernels do not "
                    "apply", NOT_YET))
    if "arange" in _sequence_ops(cls) and not positional.knows_its_positions(m):
        out.append(("computes positions with torch.arange over the tokens it is given (e.g. query scaling by "
                    "position), which under sequence parallelism are one rank's shard, not the sequence", NOT_YET))
    chunk = getattr(m, "attention_chunk_size", None) or getattr(text, "attention_chunk_size", None)
    if chunk and (seq_len is None or seq_len > int(chunk)) and not positional.chunk_layers_known(m, text):
        out.append((f"chunked attention (attention_chunk_size = {chunk}) is applied by transformers' mask, which "
                    "sequence-parallel attention does not build, so it would attend across chunks",
                    f"train sequences of at most {chunk} tokens (set \"wallfacer\": {{\"seq_len\": {chunk}}} or "
                    "less), where chunked attention equals causal attention; longer ones are not supported yet"))
    return out


def _layer_type(m: nn.Module) -> str | None:
    return getattr(m, "layer_type", None)


def _layer_type_problems(text: Any, *, mixers: set[str | None]) -> list[Finding]:
    """Layer types other than attention and those of the recognised mixer layers ("conv", "linear_attention")."""
    types = getattr(text, "layer_types", None)
    if not isinstance(types, (list, tuple)):
        return []
    known = _ATTENTION_LAYER_TYPES | _POSITIONWISE_LAYER_TYPES | {t for t in mixers if t}
    odd: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        if isinstance(t, str) and t not in known:
            odd.setdefault(t, []).append(i)
    return [Finding(path=f"config.layer_types[{idx[0]}]", cls=type(text).__name__, count=len(idx),
                    what=f"layer type {t!r} (layers {idx}) is not plain softmax attention (full or sliding window)", fix=NOT_YET)
            for t, idx in odd.items()]


def _exempt(m: nn.Module) -> bool:
    """Classes whose own code only builds what we pass in: the HF model classes (positions come as
    ``position_ids``), rotary embeddings (``rope.py`` audits them)."""
    from transformers import PreTrainedModel

    from ..adapters.rope import is_rotary

    return isinstance(m, PreTrainedModel) or is_rotary(m)


def sequence_findings(
    model: nn.Module, *, text: Any, seq_len: int | None = None, allow: Iterable[str] = (),
    attention: Iterable[nn.Module] = (),
) -> list[Finding]:
    """Every module of ``model`` that sequence parallelism would compute differently, grouped by (class, problem).
    ``attention``: the attention layers (``hf.attention_modules``); ``allow``: class names the user vouches for
    (``wallfacer.allow_modules``; the self-check still compares them)."""
    allow, attn_ids = set(allow), {id(m) for m in attention}
    # recognised mixer layers and their convolutions run on shards (mixer_layers.py)
    layers = [m for _, m in mixer_layers(model)]
    mixers = {id(x) for m in layers for x in (m, *(c for c in m.children() if isinstance(c, conv._ConvNd)))}
    near = {name: (kind, misses) for name, kind, misses in near_misses(model)}
    off_path = off_text_path(model)
    peft_wrappers, peft_problems = peft_findings(model)
    found: dict[tuple[str, str], Finding] = {}

    def add(path: str, m: nn.Module, what: str, fix: str) -> None:
        key = (type(m).__name__, what)
        old = found.get(key)
        found[key] = Finding(path, type(m).__name__, what, fix) if old is None else \
            Finding(old.path, old.cls, old.what, old.fix, old.count + 1)

    for path, m in model.named_modules():
        cls = type(m)
        if cls.__name__ in allow or id(m) in off_path or id(m) in peft_wrappers or id(m) in mixers:
            continue
        path = path or "<model>"
        drop = _dropout_problem(m)
        if drop is not None:
            add(path, m, drop, "set the model's dropout probabilities to 0.0 in its config")
        if _is_torch(cls):
            what = _torch_problem(m)
            if what is not None:
                add(path, m, what, NOT_YET)
        elif id(m) in attn_ids:
            for what, fix in _attention_problems(m, text, seq_len):
                add(path, m, what, fix)
        elif not _exempt(m):
            ops = _sequence_ops(cls)
            if ops:
                add(path, m, f"its own code calls {', '.join(ops)}, which can mix tokens along the sequence outside "
                    "the attention function", NOT_YET)
        if path in near:
            kind, misses = near[path]
            add(path, m, f"built like a {kind}, but its forward matches none of the forms ds_wallfacer runs on "
                f"shards (a transformers release may have rewritten it; {len(misses)} part(s) missing, first "
                f"{misses[0]})", NOT_YET)
    out = list(found.values()) + [Finding(path, cls, what, NOT_YET) for path, cls, what in peft_problems]
    if not attn_ids and not layers:
        out.insert(0, Finding("<model>", type(model).__name__, "has no attention layer that calls transformers' "
                              "attention interface (none carries is_causal, scaling and config), so there is no "
                              "attention for sequence parallelism to take over", NOT_YET))
    takes = inspect.signature(model.forward).parameters
    if "position_ids" not in takes and not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        out.insert(0, Finding("<model>", type(model).__name__, "its forward takes no position_ids, so it numbers "
                              "positions itself, from the tokens it is given (one rank's shard)", NOT_YET))
    if not out:
        out = _layer_type_problems(text, mixers={_layer_type(m) for m in layers})
    return out
