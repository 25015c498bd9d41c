"""The parts the preference and RL examples share (``launch/train_dpo.py``, ``launch/train_grpo.py``), on top of
the Trainer examples' (``examples.hf``): their options, the trainer's arguments (TRL's own trainer without the
``"wallfacer"`` section), the step-memory probe, the rows' length, and the JSON summary each prints last.

Imports torch, transformers and TRL only inside the functions that need them, so that ``--help`` is quick.
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from .hf import add_run_options, run_arguments

__all__ = ["add_rl_options", "rl_arguments", "rl_seq_len", "rl_summary"]


def add_rl_options(p: argparse.ArgumentParser, *, output_dir: str, unit: str) -> None:
    """The options the DPO and GRPO examples share, and every Trainer example's (``hf.add_run_options``)."""
    p.add_argument("--model", default="tiny-llama", help="a preset name, a model folder or a config.json")
    p.add_argument("--filler", type=int, default=2, help="context sentences before each question (row length)")
    p.add_argument("--lora_r", type=int, default=0, help="> 0: train a LoRA adapter of this rank (peft)")
    p.add_argument("--trainer", choices=("wallfacer", "trl"), default="wallfacer",
                   help="trl: TRL's own trainer, without sequence parallelism (the benchmark's one-rank reference)")
    p.add_argument("--measure_step", type=int, default=0,
                   help="> 0: the activation bytes of that training step on rank 0 (saved for backward, per "
                        "micro-step; the benchmark's memory figure; not under ZeRO-3)")
    add_run_options(p, output_dir=output_dir, unit=unit)


def rl_arguments(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The trainer's arguments from the shared options (TRL's own trainer, ``--trainer trl``: the ds_config without
    its ``"wallfacer"`` section) and the step-memory probe (``--measure_step``)."""
    from ..hf_trainer.metrics import StepActivationBytes

    run = run_arguments(args)
    if args.measure_step and (run["deepspeed"].get("zero_optimization") or {}).get("stage") == 3:
        raise SystemExit("--measure_step reads the tensors autograd saves, which hands ZeRO-3's gathered parameters "
                         "back without their ZeRO attributes: measure under ZeRO stage 0-2")
    if args.trainer == "trl":
        run["deepspeed"] = {k: v for k, v in run["deepspeed"].items() if k != "wallfacer"}
    return run, StepActivationBytes(args.measure_step)


def rl_seq_len(args: argparse.Namespace) -> int:
    """The model's position budget for rows with ``--filler`` context sentences: 64 tokens per sentence, with room
    for two more (the question, the answer)."""
    return 64 * (args.filler + 2)


def rl_summary(trainer: Any, result: Any, metrics: dict, output_dir: str, **extra: Any) -> dict[str, Any]:
    """The last line: the last logged loss, the eval loss, steps, tokens per second over all ranks (TRL's
    ``num_tokens``, the largest logged: the batches' real tokens; GRPO logs it on generation steps only), the layout
    (TRL's own trainer: one rank's, no mode)."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    last = logs[-1] if logs else {}
    sp = getattr(trainer, "sequence_parallel", None)  # None: TRL's own trainer (--trainer trl)
    runtime = result.metrics.get("train_runtime") or float("nan")
    return {"final_loss": last.get("loss"), "eval_loss": metrics.get("eval_loss"), "steps": result.global_step,
            "tokens_per_s": max((h.get("num_tokens") or 0 for h in logs), default=0) / runtime,
            "sequence_parallel_size": sp.setup.dims.sp_size if sp else 1, "mode": sp.setup.dims.mode if sp else None,
            "world_size": trainer.args.world_size, "output_dir": os.path.abspath(output_dir), **extra}
