"""Export the trained model as a plain HF checkpoint (``save_pretrained`` layout + tokenizer).

The module DeepSpeed wraps is ``SequenceParallelCausalLM``; the HF model is its ``.lm``, so its own
``state_dict`` has no ``lm.`` prefix. Under ZeRO-3 every rank holds a slice of each parameter:
``deepspeed.zero.GatheredParameters`` assembles them (a collective on every rank), rank 0 copies them out and
writes. Weights are written in the training dtype (like ``engine.save_16bit_model``). The config is written with
no attention implementation, so ``AutoModelForCausalLM.from_pretrained`` picks its default and ``--model`` of the
next run sets ``"wallfacer"`` again.
"""
from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["export_hf"]


def _full_state_dict(lm: nn.Module, *, zero_stage: int) -> dict[str, torch.Tensor] | None:
    """Every rank calls it; rank 0 gets a CPU state dict, the others None."""
    rank = dist.get_rank()
    ctx: Any = contextlib.nullcontext()
    if zero_stage == 3:
        import deepspeed

        ctx = deepspeed.zero.GatheredParameters(list(lm.parameters()), modifier_rank=None)
    with ctx:
        if rank != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in lm.state_dict().items()}


def export_hf(lm: nn.Module, tokenizer: Any, out_dir: str | Path, *, zero_stage: int) -> Path | None:
    """Write ``out_dir`` (rank 0) and return it there; None on other ranks. Collective."""
    out_dir = Path(out_dir)
    state = _full_state_dict(lm, zero_stage=zero_stage)
    if dist.get_rank() == 0:
        assert state is not None
        out_dir.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(lm.config)
        config._attn_implementation = None  # not the training-only "wallfacer"
        lm.config, saved = config, lm.config
        try:
            lm.save_pretrained(str(out_dir), state_dict=state, safe_serialization=True)
        finally:
            lm.config = saved
        tokenizer.save_pretrained(str(out_dir))
    dist.barrier()
    return out_dir if dist.get_rank() == 0 else None
