"""Shared pieces of the parity tests: the ds_config of a parity run, the ZeRO section that really partitions tiny
models, the training loop on the engine with its step-0 checks, and the comparison of every trained parameter with
the non-parallel run's."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

__all__ = ["Case", "LOSS_RTOL", "first_step_failures", "finish", "parity_config", "param_failures", "run_cases",
           "train", "zero_section"]


@dataclass(frozen=True)
class Case:
    """One parity run: the model family, ZeRO stage and ``"wallfacer"`` section; full sequence length, sequences
    per micro-batch, gradient accumulation steps, padding tokens at the end of each row, extra ds_config keys."""

    family: str
    stage: int
    wallfacer: dict
    seq_len: int = 32
    batch_size: int = 1
    gas: int = 1
    pad: int = 0
    extra: dict = field(default_factory=dict)

    def name(self) -> str:
        return (f"{self.family}/zero{self.stage}/{self.wallfacer}/N={self.seq_len}/B={self.batch_size}/gas={self.gas}"
                f"/pad={self.pad}")

LOSS_RTOL = 1e-5
"""Step-0 losses: relative to max(1, |reference|)."""


def parity_config(*, stage: int, wallfacer: dict, micro_batch: int = 1, **extra: Any) -> dict:
    """The ds_config of a parity run: the client's SGD, no gradient clipping (clipping and Adam hide constant
    gradient factors), ``zero_section(stage)``."""
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_clipping": 0,
            "zero_optimization": zero_section(stage), "zero_allow_untested_optimizer": True, "wallfacer": wallfacer,
            **extra}


def first_step_failures(got: float, want: float, what: str = "loss") -> list[str]:
    """A step-0 value against the non-parallel run's, within ``LOSS_RTOL``."""
    if abs(got - want) <= LOSS_RTOL * max(1.0, abs(want)):
        return []
    return [f"step 0 {what} {got:.7f} != non-parallel {want:.7f}"]


def train(engine: Any, sp: Any, batches: Iterable[dict], check: Callable[[int, torch.Tensor], list[str]]) -> list[str]:
    """One engine step per full batch (sharded by ``sp``); ``check(i, loss)`` says what differs at batch i."""
    failures = []
    for i, batch in enumerate(batches):
        loss = engine(**sp.shard(batch))
        failures += check(i, loss)
        engine.backward(loss)
        engine.step()
    return failures


def finish(engine: Any, ref_params: dict[str, torch.Tensor], failures: list[str], *, steps: int, name: str,
           rank: int) -> list[str]:
    """The loop's failures and every parameter's (``param_failures``), labelled; the engine destroyed."""
    failures = failures + param_failures(engine, ref_params, steps=steps)
    engine.destroy()
    return [f"[{name}] rank {rank}: {f}" for f in failures]


def run_cases(rank: int, world: int, run_case: Callable[[int, int, Any], list[str]], cases: list) -> list[str]:
    """Every case on this rank, one after another (``run_distributed(run_cases, world, run_case, cases)``)."""
    return [f for case in cases for f in run_case(rank, world, case)]


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
