"""Decoder-layer activation checkpointing for MsT: DeepSpeed's, torch's, or none (``enable_layer_checkpointing``).

"deepspeed" uses ``deepspeed.checkpointing.checkpoint`` configured from the ds_config ``"activation_checkpointing"``
section; "torch" uses non-reentrant ``torch.utils.checkpoint``. Either keeps only each decoder layer's input between
forward and backward. The layer recompute does not run the mini-sequence MLP's forward again where its value is not
needed, and with ``keep_attention`` (the default) attention's results are handed back rather than recomputed
(``attention.residuals.KeepAttention``).

Design: Note [Mini-sequence MLP under layer checkpointing] and Note [Attention once under layer checkpointing] in
docs/design/memory.md.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["MlpRecomputeFlag", "RecomputeState", "disable_layer_checkpointing", "enable_layer_checkpointing"]


class MlpRecomputeFlag:
    """Per wrapped MLP: whether its output value is needed in a layer recompute (learned:
    Note [Mini-sequence MLP under layer checkpointing] in docs/design/memory.md)."""

    def __init__(self) -> None:
        self.needs_value = False


class RecomputeState:
    """Shared by one model's MLP wrappers and its DeepSpeed checkpoint function (instance state, no globals)."""

    def __init__(self) -> None:
        self.active = False
        """True while DeepSpeed recomputes a layer: MLPs without ``needs_value`` return placeholders."""
        self.placeholders: list[tuple[torch.autograd.graph.Node, MlpRecomputeFlag]] = []
        """(autograd node of the placeholder, its MLP's flag), in the order of the recompute."""

    def placeholder_for(self, flag: MlpRecomputeFlag) -> bool:
        return self.active and not flag.needs_value

    def record(self, flag: MlpRecomputeFlag, out: torch.Tensor) -> None:
        self.placeholders.append((out.grad_fn, flag))


def _saves_tensor(node: torch.autograd.graph.Node) -> bool:
    if isinstance(node, torch.autograd.function.BackwardCFunction):  # a custom Function: its ctx is the node
        if node.saved_tensors:
            return True
        return any(
            isinstance(v, torch.Tensor) or (isinstance(v, (list, tuple)) and any(torch.is_tensor(t) for t in v))
            for v in vars(node).values()
        )
    # built-in nodes: _raw_saved_<name> for each tensor slot, _saved_<name> its value (None when not saved)
    for name in dir(node):
        if name.startswith("_raw_saved_"):
            v = getattr(node, "_saved_" + name.removeprefix("_raw_saved_"), None)
            if any(t is not None for t in (v if isinstance(v, (list, tuple)) else [v])):
                return True
    return False


def _nothing_saved_after(outputs: Any, first: torch.autograd.graph.Node) -> bool:
    """True if no autograd node created after ``first`` and reachable from ``outputs`` saved a tensor.

    A node's inputs are always created before it (sequence numbers increase within one thread), so the walk stops
    at nodes older than ``first``: it visits only the tail of this layer's graph.
    """
    seq0 = first._sequence_nr()
    tensors = [outputs] if isinstance(outputs, torch.Tensor) else [t for t in outputs if isinstance(t, torch.Tensor)]
    todo = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: set = set()
    while todo:
        node = todo.pop()
        if node in seen or node is first or node._sequence_nr() < seq0:
            continue
        seen.add(node)
        if _saves_tensor(node):
            return False
        todo.extend(nxt for nxt, _ in node.next_functions if nxt is not None)
    return True


class _DeepSpeedCheckpoint:
    """Callable given to HF layers; configures DeepSpeed checkpointing from the ds_config once, then checkpoints."""

    def __init__(self, ds_config: dict[str, Any] | None, state: RecomputeState | None) -> None:
        from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

        # DeepSpeed's own parser of its "activation_checkpointing" section (defaults: all off)
        self.settings = DeepSpeedActivationCheckpointingConfig(ds_config or {})
        self.state = state
        self._configured = False

    def _configure(self) -> None:
        import deepspeed
        import deepspeed.comm as ds_dist
        import torch.distributed as dist

        if not ds_dist.is_initialized():
            if not dist.is_initialized():
                raise RuntimeError(
                    'mini_sequence.activation_checkpointing = "deepspeed" needs torch.distributed to be initialised '
                    '(deepspeed.initialize / deepspeed.init_distributed); use "torch" in a plain single process'
                )
            deepspeed.init_distributed(dist_backend=dist.get_backend())
        from deepspeed.accelerator import get_accelerator

        s = self.settings
        # On the CPU accelerator the saved inputs already live in host memory, and DeepSpeed 0.19's blocking
        # cpu_checkpointing path there empties the saved input before keeping it (it is its own "copy"): off.
        offload = bool(s.cpu_checkpointing) and get_accelerator().device_name() != "cpu"
        deepspeed.checkpointing.configure(
            None,
            partition_activations=bool(s.partition_activations),
            contiguous_checkpointing=bool(s.contiguous_memory_optimization),
            num_checkpoints=s.number_checkpoints,
            checkpoint_in_cpu=offload,
            synchronize=bool(s.synchronize_checkpoint_boundary),
            profile=bool(s.profile),
        )
        self._configured = True

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        import deepspeed

        if not self._configured:
            self._configure()
        if self.state is None:
            return deepspeed.checkpointing.checkpoint(function, *args, **kwargs)
        calls = 0

        def run(*a: Any, **kw: Any) -> Any:
            nonlocal calls
            calls += 1  # DeepSpeed calls it once in forward (no_grad), then once per backward to recompute
            return function(*a, **kw) if calls == 1 else self._recompute(function, a, kw)

        return deepspeed.checkpointing.checkpoint(run, *args, **kwargs)

    def _recompute(self, function: Callable, args: tuple, kwargs: dict) -> Any:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.activation_checkpointing.checkpointing import get_cuda_rng_tracker

        state = self.state
        assert state is not None and not state.active, "nested DeepSpeed checkpoint recompute"
        # DeepSpeed has just restored the forward's RNG states; keep them for a second recompute (dropout masks)
        rng = (torch.get_rng_state(), get_accelerator().get_rng_state(), get_cuda_rng_tracker().get_states())
        state.active, state.placeholders = True, []
        try:
            outputs = function(*args, **kwargs)
        finally:
            state.active, placeholders = False, state.placeholders
            state.placeholders = []
        if not placeholders or _nothing_saved_after(outputs, placeholders[0][0]):
            return outputs
        # something after an MLP may hold a value computed from its placeholder (e.g. Gemma's post-feed-forward norm)
        for _, flag in placeholders:
            flag.needs_value = True
        del outputs
        torch.set_rng_state(rng[0])
        get_accelerator().set_rng_state(rng[1])
        get_cuda_rng_tracker().set_states(rng[2])
        return function(*args, **kwargs)


def _torch_checkpoint() -> Callable:
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def enable_layer_checkpointing(
    model: nn.Module,
    mode: str,
    *,
    ds_config: dict[str, Any] | None = None,
    state: RecomputeState | None = None,
    keep_attention: bool = True,
    offload: bool = False,
) -> None:
    """Checkpoint every decoder layer of an HF model with ``mode`` ("deepspeed" | "torch"); "none" does nothing.

    ``state``: shared with the model's mini-sequence MLPs, lets DeepSpeed's recompute skip their forward.
    ``keep_attention``: the recompute reuses attention's first-forward results (``attention/residuals.py``).
    ``offload``: the layer inputs wait in host memory until their recompute (``mst/offload.py``).
    """
    if mode == "none":
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing of its decoder layers")
    func: Callable = _DeepSpeedCheckpoint(ds_config, state) if mode == "deepspeed" else _torch_checkpoint()
    if offload:
        from .offload import OffloadInputs

        func = OffloadInputs(func)
    if keep_attention:
        from ..attention.residuals import KeepAttention

        func = KeepAttention(func)
    # the hook HF itself uses to install a checkpoint function on every GradientCheckpointingLayer
    model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=func)
    if mode == "deepspeed" and hasattr(model, "enable_input_require_grads"):
        # reentrant checkpointing loses parameter gradients when no layer input requires grad (frozen embeddings)
        emb = model.get_input_embeddings()
        if emb is not None and not any(p.requires_grad for p in emb.parameters()):
            model.enable_input_require_grads()


def disable_layer_checkpointing(model: nn.Module) -> None:
    """Turn decoder-layer checkpointing off again."""
    if getattr(model, "supports_gradient_checkpointing", False):
        model._set_gradient_checkpointing(enable=False)
