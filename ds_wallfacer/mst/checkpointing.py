"""Decoder-layer activation checkpointing for MsT (issue 3): DeepSpeed's, torch's, or none.

With checkpointing only each decoder layer's input is kept between forward and backward (DESIGN.md section 4).
"deepspeed" uses ``deepspeed.checkpointing.checkpoint`` configured from the ds_config ``"activation_checkpointing"``
section (partition_activations, cpu_checkpointing = CPU offload of the saved layer inputs,
contiguous_memory_optimization, number_checkpoints, synchronize_checkpoint_boundary, profile). DeepSpeed keeps that
configuration in its own module state; it is applied on the first checkpointed call, when ``deepspeed.comm`` is up
(after ``deepspeed.initialize`` or ``deepspeed.init_distributed``). "torch" uses non-reentrant
``torch.utils.checkpoint``.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["enable_layer_checkpointing", "disable_layer_checkpointing"]


class _DeepSpeedCheckpoint:
    """Callable given to HF layers; configures DeepSpeed checkpointing from the ds_config once, then checkpoints."""

    def __init__(self, ds_config: dict[str, Any] | None) -> None:
        from deepspeed.runtime.activation_checkpointing.config import DeepSpeedActivationCheckpointingConfig

        # DeepSpeed's own parser of its "activation_checkpointing" section (defaults: all off)
        self.settings = DeepSpeedActivationCheckpointingConfig(ds_config or {})
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
        return deepspeed.checkpointing.checkpoint(function, *args, **kwargs)


def _torch_checkpoint() -> Callable:
    return functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)


def enable_layer_checkpointing(model: nn.Module, mode: str, *, ds_config: dict[str, Any] | None = None) -> None:
    """Checkpoint every decoder layer of an HF model with ``mode`` ("deepspeed" | "torch"); "none" does nothing."""
    if mode == "none":
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing of its decoder layers")
    func = _DeepSpeedCheckpoint(ds_config) if mode == "deepspeed" else _torch_checkpoint()
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
