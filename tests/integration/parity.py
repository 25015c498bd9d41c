"""Shared pieces of the parity tests: the ZeRO section that really partitions tiny models, and the comparison of
every trained parameter with the non-parallel run's."""
from __future__ import annotations

import torch

__all__ = ["param_failures", "zero_section"]


def zero_section(stage: int) -> dict:
    """``zero_optimization`` for ``stage``; with stage 3 tiny parameters would otherwise stay unpartitioned
    ("persistent") and ZeRO-3 would not be exercised."""
    zero: dict = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_max_live_parameters=0, stage3_prefetch_bucket_size=0)
    return zero


def param_failures(engine, ref_params: dict[str, torch.Tensor], *, steps: int) -> list[str]:
    """Every parameter of the engine's HF model (gathered fp32) against the reference, rtol 1e-4, atol 2e-6."""
    from deepspeed.utils import safe_get_full_fp32_param

    failures = []
    for name, p in engine.module.named_parameters():
        key = name.removeprefix("lm.")
        w = safe_get_full_fp32_param(p)
        if not torch.allclose(w, ref_params[key], rtol=1e-4, atol=2e-6):
            failures.append(f"param {key} after {steps} steps: max err {(w - ref_params[key]).abs().max().item():.3g}")
    return failures
