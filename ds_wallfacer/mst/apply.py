"""Apply MsT to an HF causal LM from outside (torchtitan style): wrap MLP and LM-head forwards per instance.

Parameter names and state_dict keys are unchanged (only instance ``forward`` attributes are set; ``remove()``
deletes them again); no model class is edited. Call before ``deepspeed.initialize`` (ZeRO-3 hooks are registered
there and must see the MLPs as leaf modules).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..attention.residuals import keep_attention_in_layers
from ..hf_config import text_config
from .checkpointing import MlpRecomputeFlag, RecomputeState, disable_layer_checkpointing, enable_layer_checkpointing
from .config import MiniSequenceConfig, ResolvedSizes, resolve_sizes
from .lm_head import _MST_ATTR, chunked_linear_cross_entropy
from .mlp import check_position_wise, mini_sequence_mlp
from .norm import LeanNormForward, norm_form

__all__ = ["MiniSequenceHandle", "apply_activation_memory", "apply_mini_sequence", "find_decoder_layers"]

_AUTO_MLP_NAMES = ("mlp", "feed_forward", "ffn")


class _MlpForward:
    """Instance ``forward`` of a wrapped MLP: the original forward, run in mini-sequences."""

    def __init__(self, orig: Callable, chunk_tokens: int, state: RecomputeState) -> None:
        self.orig = orig
        self.chunk_tokens = chunk_tokens
        self.state = state
        self.flag = MlpRecomputeFlag()

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self.orig(x, *args, **kwargs)
        params = [p for p in self.orig.__self__.parameters() if p.requires_grad]
        placeholder = self.state.placeholder_for(self.flag)  # in a DeepSpeed layer recompute (checkpointing.py)
        out = mini_sequence_mlp(self.orig, x, params, chunk_tokens=self.chunk_tokens, placeholder=placeholder)
        if placeholder and out.grad_fn is not None:
            self.state.record(self.flag, out)
        return out


class _HeadForward:
    """Instance ``forward`` of the LM head: unchanged, unless called with ``mst_labels`` (then the chunked loss)."""

    def __init__(self, orig: Callable) -> None:
        self.orig = orig

    def __call__(
        self,
        x: torch.Tensor,
        *args: Any,
        mst_labels: torch.Tensor | None = None,
        mst_chunk_tokens: int = 0,
        mst_ignore_index: int = -100,
        mst_softcap: float | None = None,
        mst_scale: float | None = None,
        mst_divisor: float | None = None,
        **kwargs: Any,
    ) -> Any:
        if mst_labels is None:
            return self.orig(x, *args, **kwargs)
        head = self.orig.__self__
        return chunked_linear_cross_entropy(
            x, mst_labels, head.weight, head.bias, chunk_tokens=mst_chunk_tokens, ignore_index=mst_ignore_index,
            softcap=mst_softcap, scale=mst_scale, divisor=mst_divisor,
        )


@dataclass
class MiniSequenceHandle:
    """What ``apply_mini_sequence`` changed; ``remove()`` undoes it."""

    model: nn.Module
    """The model that was modified."""
    config: MiniSequenceConfig
    """The settings applied."""
    sizes: ResolvedSizes
    """Tokens per mini-sequence after "auto" (the *_chunks fields are for hidden_size tokens, informational)."""
    mlp_modules: list[str] = field(default_factory=list)
    """Qualified names of the MLPs now run in mini-sequences."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Auto-detected candidates left alone, with the reason (e.g. not position-wise)."""
    lm_head: str | None = None
    """Qualified name of the wrapped LM head (None when mini_sequence.lm_head is false)."""
    norm_modules: list[str] = field(default_factory=list)
    """Qualified names of the RMSNorms now run lean (``mst/norm.py``)."""

    def remove(self) -> None:
        """Restore the original forwards and turn layer checkpointing off again (if it was turned on here)."""
        for name in self.mlp_modules:
            mod = self.model.get_submodule(name)
            if "forward" in mod.__dict__:
                del mod.forward
        for name in self.norm_modules:
            self.model.get_submodule(name).__dict__.pop("forward", None)
        if self.lm_head is not None:
            head = self.model.get_submodule(self.lm_head)
            head.__dict__.pop("forward", None)
            head.__dict__.pop(_MST_ATTR, None)
        if self.config.activation_checkpointing != "none":
            disable_layer_checkpointing(self.model)
        self.mlp_modules, self.norm_modules, self.lm_head = [], [], None


def find_decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated decoder blocks: HF ``GradientCheckpointingLayer``s, else the items of the largest ModuleList."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    name, biggest = max(lists, key=lambda nm: len(nm[1]))
    return [(f"{name}.{i}", m) for i, m in enumerate(biggest)]


def _hidden_size(model: nn.Module) -> int:
    return int(text_config(model).hidden_size)


def _router_classes(model: nn.Module) -> tuple[type, ...]:
    # the classes transformers records router logits from (``_can_record_outputs``) in any sub-model
    out = []
    for m in model.modules():
        spec = (getattr(m, "_can_record_outputs", None) or {}).get("router_logits")
        for s in spec if isinstance(spec, list) else [spec]:
            cls = getattr(s, "target_class", s)
            if isinstance(cls, type):
                out.append(cls)
    return tuple(out)


def _moe_block(model: nn.Module, module: nn.Module) -> str | None:
    """Why ``module`` is a mixture-of-experts block (left alone), or None. Its routing is per token, but its
    router logits are outputs the model's aux loss differentiates: run under no_grad and recomputed in backward,
    they would reach the loss without their gradient."""
    routers = _router_classes(model)
    if any(isinstance(m, routers) for m in module.modules()) or hasattr(module, "experts"):
        return ("a mixture-of-experts block (router + experts): its router logits feed the aux loss with their "
                "gradient, which the mini-sequence MLP's no-grad forward would drop; left unchunked")
    return None


def _mark_zero3_leaf(name: str, module: nn.Module) -> None:
    if any(hasattr(m, "ds_id") for m in module.children()):
        raise RuntimeError(
            f"{name} already has ZeRO-3 hooks on its sub-modules: call apply_mini_sequence before "
            f"deepspeed.initialize"
        )
    from deepspeed.utils import set_z3_leaf_module

    # ZeRO-3 then gathers all the MLP's parameters once for all mini-sequences (forward and backward)
    set_z3_leaf_module(module, True)


def apply_mini_sequence(
    model: nn.Module,
    config: MiniSequenceConfig | dict[str, Any] | None = None,
    *,
    ds_config: dict[str, Any] | None = None,
) -> MiniSequenceHandle:
    """Run the MLPs and (via ``mini_sequence_causal_lm_loss``) the LM head of ``model`` in mini-sequences.

    ``config`` is the ``"wallfacer": {"mini_sequence": ...}`` section (dataclass or raw dict); ``ds_config`` the
    whole DeepSpeed config (its ``"activation_checkpointing"`` section configures DeepSpeed checkpointing).
    Raises ValueError when a forced MLP (``mlp_module_names``) is missing or not position-wise.
    """
    if not isinstance(config, MiniSequenceConfig):
        config = MiniSequenceConfig.from_dict(config)
    hidden = _hidden_size(model)
    head = model.get_output_embeddings()
    vocab = head.out_features if isinstance(head, nn.Linear) else 1
    sizes = resolve_sizes(config, tokens=hidden, hidden_size=hidden, vocab_size=vocab)
    handle = MiniSequenceHandle(model=model, config=config, sizes=sizes)
    # shared by this model's MLP wrappers and its DeepSpeed checkpoint function (applied twice: the first one's)
    wrapped = [m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), _MlpForward)]
    state = wrapped[0].state if wrapped else RecomputeState()
    if config.mlp:
        _wrap_mlps(model, config, handle, state, hidden=hidden)
    if config.lm_head:
        handle.lm_head = _wrap_lm_head(model, head, sizes.lm_head_chunk_tokens)
    if config.norm:
        handle.norm_modules = _wrap_norms(model)
    enable_layer_checkpointing(model, config.activation_checkpointing, ds_config=ds_config, state=state,
                               keep_attention=config.keep_attention, offload=config.offload_checkpoints)
    return handle


def apply_activation_memory(
    model: nn.Module, config: MiniSequenceConfig | None, *, ds_config: dict[str, Any]
) -> MiniSequenceHandle | None:
    """The start-up step for activation memory: Mini-Sequence chunking when ``config`` (``wallfacer.mini_sequence``)
    is set, then, unless its ``keep_attention`` is off, attention's results kept for the recompute of every
    checkpointed layer, also those the caller checkpointed itself (Note [Attention once under layer checkpointing]).
    Returns the MsT handle, None without MsT."""
    handle = apply_mini_sequence(model, config, ds_config=ds_config) if config is not None else None
    if config is None or config.keep_attention:
        keep_attention_in_layers(model)
    return handle


def _wrap_mlps(
    model: nn.Module, config: MiniSequenceConfig, handle: MiniSequenceHandle, state: RecomputeState, *, hidden: int
) -> None:
    """Wrap every decoder layer's position-wise MLP (the forced names, or the usual ones found by the probe);
    record wrapped and skipped modules in ``handle``."""
    forced = config.mlp_module_names is not None
    names = config.mlp_module_names or _AUTO_MLP_NAMES
    layers = find_decoder_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__}: found no decoder layers to look for MLP modules in")
    for lname, layer in layers:
        found = [(n, getattr(layer, n)) for n in names if isinstance(getattr(layer, n, None), nn.Module)]
        if forced and not found:
            raise ValueError(f"mini_sequence.mlp_module_names={list(names)}: {lname} has no such child module")
        for n, mod in found:
            qual = f"{lname}.{n}"
            if isinstance(mod.__dict__.get("forward"), _MlpForward):
                handle.mlp_modules.append(qual)  # applied twice: keep the first wrapping
                continue
            why = _moe_block(model, mod) or check_position_wise(mod, mod.forward, hidden)
            if why is not None:
                if forced:
                    raise ValueError(
                        f"{qual} ({type(mod).__name__}) is not a position-wise MLP: {why}; it cannot run in "
                        f"mini-sequences (remove it from mini_sequence.mlp_module_names)"
                    )
                handle.skipped[qual] = why
                continue
            _mark_zero3_leaf(qual, mod)
            mod.forward = _MlpForward(mod.forward, handle.sizes.mlp_chunk_tokens, state)
            handle.mlp_modules.append(qual)


def _wrap_norms(model: nn.Module) -> list[str]:
    """Run every recognised RMSNorm of ``model`` lean; returns their qualified names."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m.__dict__.get("forward"), LeanNormForward):
            names.append(name)  # applied twice
            continue
        form = norm_form(m)
        if form is not None:
            m.forward = LeanNormForward(m, form)
            names.append(name)
    return names


def _wrap_lm_head(model: nn.Module, head: Any, chunk_tokens: int) -> str:
    """Let the LM head compute the chunked loss when called with ``mst_labels``; returns its qualified name."""
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}.get_output_embeddings() is {type(head).__name__}; the mini-sequence LM "
            f"head needs an nn.Linear (set mini_sequence.lm_head to false)"
        )
    if not isinstance(head.__dict__.get("forward"), _HeadForward):
        head.forward = _HeadForward(head.forward)
    setattr(head, _MST_ATTR, chunk_tokens)
    return next(n for n, m in model.named_modules() if m is head)
