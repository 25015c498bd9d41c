"""The parts the Trainer examples share (``launch/train_hf.py``, ``train_trl.py``, ``train_dpo.py``,
``train_grpo.py``): their options, the ``TrainingArguments`` keywords those give, the process group started before
the model, the model and its tokenizer, the text data, LoRA, and the JSON summary each prints last. Each script
reads top to bottom with these: parse, build, train, close.

Imports torch, transformers and DeepSpeed only inside the functions that need them, so that ``--help`` is quick.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["add_run_options", "chat_tokenizer", "load_example_model", "lora_config", "print_summary",
           "resume_argument", "run_arguments", "start_distributed", "token_datasets", "trainer_summary"]


def add_run_options(p: argparse.ArgumentParser, *, output_dir: str, unit: str) -> None:
    """The options every Trainer example has: the ds_config, steps, batch, learning rate, evaluation, checkpoints."""
    p.add_argument("--deepspeed_config", default="wallfacer", help="example name or path of a ds_config")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro_batch", type=int, default=1, help=f"{unit} per micro-step per sequence-parallel group")
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval_steps", type=int, default=4)
    p.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints")
    p.add_argument("--resume", default=None, help="a checkpoint folder, or 'last'")
    p.add_argument("--output_dir", default=output_dir)
    p.add_argument("--report_to", default="none", help="none or wandb (offline unless WANDB_MODE says otherwise)")
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)  # set by the deepspeed launcher


def run_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """``TrainingArguments`` keywords from the shared options (TRL's configs take the same): batch, steps,
    evaluation, checkpoints, reporting, the ds_config, CPU ranks where there is no GPU, bf16 as the config says."""
    import torch

    from . import trainer_config

    cfg = trainer_config(args.deepspeed_config)
    return dict(
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch, per_device_eval_batch_size=1,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        eval_strategy="steps", eval_steps=args.eval_steps, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[] if args.report_to == "none" else [args.report_to], deepspeed=cfg, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), bf16=bool((cfg.get("bf16") or {}).get("enabled")),
    )


def start_distributed() -> None:
    """DeepSpeed's process group, before the model: ZeRO-3 builds the model partitioned (``zero.Init``), sized by
    DeepSpeed's world. On GPUs the ``TrainingArguments`` would start it; with ``use_cpu`` they do not."""
    import deepspeed

    deepspeed.init_distributed()


def load_example_model(name: str, *, seq_len: int, seed: int, attention: str | None = None) -> Any:
    """``train.model.load_model`` in fp32 (a preset name, a model folder or a config.json); ``attention``: the
    model's ``attn_implementation`` instead (TRL's own trainer, ``--trainer trl``, attends with ``"sdpa"``)."""
    import torch

    from ..train.model import load_model

    loaded = load_model(name, seq_len=seq_len, dtype=torch.float32, seed=seed)
    if attention is not None:
        loaded.model.set_attn_implementation(attention)
    return loaded


def token_datasets(args: argparse.Namespace, loaded: Any) -> tuple[list[dict], list[dict]]:
    """Sequences of ``--seq_len`` tokens cut from ``--data`` (documents joined by EOS); 10% held out."""
    from ..train.data import token_rows

    return token_rows(args.data, loaded.tokenizer, tokenizer_id=loaded.tokenizer_id, eos_id=loaded.eos_id,
                      seq_len=args.seq_len, cache_dir=Path(args.output_dir) / "cache")


def chat_tokenizer(loaded: Any) -> Any:
    """The model folder's tokenizer when it has a chat template, else the examples' byte-level chat tokenizer
    (``hf_trainer.chat``: a template that marks assistant turns)."""
    from ..hf_trainer.chat import chat_tokenizer as byte_chat_tokenizer

    tok = loaded.tokenizer
    if getattr(tok, "chat_template", None):
        return tok
    return byte_chat_tokenizer()


def lora_config(r: int, *, away_from_base: bool = False) -> Any:
    """A LoRA adapter of rank ``r`` on every linear layer (peft), or None for ``r`` <= 0 (full training);
    ``away_from_base``: both matrices random (peft's ``init_lora_weights=False``), so that the adapted model starts
    away from its base model (a KL term to the base then has a gradient from the first step)."""
    if r <= 0:
        return None
    from peft import LoraConfig

    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear",
                      init_lora_weights=not away_from_base)


def resume_argument(args: argparse.Namespace) -> bool | str | None:
    """``--resume`` as ``Trainer.train(resume_from_checkpoint=...)`` takes it: ``last`` is True."""
    return True if args.resume == "last" else args.resume


def trainer_summary(trainer: Any, result: Any, metrics: dict, output_dir: str, **extra: Any) -> dict[str, Any]:
    """The Trainer and SFT examples' last line: the last logged training loss, the eval loss, steps, and tokens per
    second over all ranks (real tokens trained on, padding left out; ``WallfacerTrainer.wallfacer_metrics``)."""
    dims = trainer.sequence_parallel.setup.dims
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    runtime = result.metrics.get("train_runtime") or float("nan")
    return {"final_loss": losses[-1] if losses else None, "eval_loss": metrics["eval_loss"],
            "steps": result.global_step, "tokens_per_s": trainer.wallfacer_metrics.total_tokens / runtime,
            "sequence_parallel_size": dims.sp_size, "mode": dims.mode, "world_size": dims.world_size,
            "output_dir": os.path.abspath(output_dir), **extra}


def print_summary(summary: dict[str, Any]) -> None:
    """The JSON summary as the last line printed (call it on rank 0 only)."""
    print(json.dumps(summary), flush=True)
