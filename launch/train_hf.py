"""Train with transformers' own ``Trainer`` and sequence parallelism: the example of ``ds_wallfacer.hf_trainer``.

    deepspeed --num_gpus 4 launch/train_hf.py --deepspeed_config wallfacer --seq_len 512 --steps 20

A plain Trainer script (model, local text data, ``TrainingArguments(deepspeed=...)``, evaluation, checkpoints)
whose one change is ``WallfacerTrainer`` in place of ``Trainer``. ``--deepspeed_config``: a shipped example's
name (``ds_wallfacer/examples/configs``) or a path; the Trainer's arguments own the batch sizes, gradient clipping
and learning rate, so the example sets those keys of the config to "auto". Runs on CPU ranks (gloo) where there
is no GPU. The last line printed (rank 0) is a JSON summary: final_loss, eval_loss, steps, tokens_per_s.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's package, also when not installed

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ds_wallfacer import examples

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="a preset name, a model folder or a config.json")
    p.add_argument("--data", default=str(examples.DATA_DIR), help="local text: .txt / .jsonl / .parquet or a folder")
    p.add_argument("--seq_len", type=int, default=256)
    add_run_options(p, output_dir="runs/hf", unit="sequences")
    return p.parse_args(argv)


def add_run_options(p: argparse.ArgumentParser, *, output_dir: str, unit: str) -> None:
    """The options both examples share: the ds_config, steps, batch, learning rate, evaluation, checkpoints."""
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


def run_arguments(args: argparse.Namespace) -> dict:
    """``TrainingArguments`` keywords from the shared options (``SFTConfig`` takes the same): batch, steps,
    evaluation, checkpoints, reporting, the ds_config, CPU ranks where there is no GPU, bf16 as the config says."""
    import torch

    from ds_wallfacer.examples import trainer_config

    cfg = trainer_config(args.deepspeed_config)
    return dict(
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch, per_device_eval_batch_size=1,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        eval_strategy="steps", eval_steps=args.eval_steps, logging_steps=1,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to=[] if args.report_to == "none" else [args.report_to], deepspeed=cfg, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), bf16=bool((cfg.get("bf16") or {}).get("enabled")),
    )


def datasets_of(args: argparse.Namespace, loaded) -> tuple[list[dict], list[dict]]:
    """Sequences of ``--seq_len`` tokens cut from the text (documents joined by EOS); 10% held out."""
    from ds_wallfacer.train.data import token_rows

    return token_rows(args.data, loaded.tokenizer, tokenizer_id=loaded.tokenizer_id, eos_id=loaded.eos_id,
                      seq_len=args.seq_len, cache_dir=Path(args.output_dir) / "cache")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import TrainingArguments, default_data_collator

    from ds_wallfacer.hf_trainer import WallfacerTrainer
    from ds_wallfacer.train.model import load_model

    training = TrainingArguments(**run_arguments(args))
    import deepspeed

    # ZeRO-3 builds the model partitioned (zero.Init), sized by DeepSpeed's world: start it first (on GPUs the
    # TrainingArguments would; with use_cpu they do not)
    deepspeed.init_distributed()
    loaded = load_model(args.model, seq_len=args.seq_len, dtype=torch.float32, seed=training.seed)
    train_set, eval_set = datasets_of(args, loaded)
    trainer = WallfacerTrainer(model=loaded.model, args=training, train_dataset=train_set, eval_dataset=eval_set,
                               data_collator=default_data_collator)
    resume = True if args.resume == "last" else args.resume
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(json.dumps(summary(trainer, result, metrics, args.output_dir)))
    return 0


def summary(trainer, result, metrics: dict, output_dir: str, **extra) -> dict:
    """The last line: the last logged training loss, the eval loss, steps, and tokens per second over all ranks
    (real tokens trained on, padding left out; ``WallfacerTrainer.wallfacer_metrics``)."""
    dims = trainer.sequence_parallel.setup.dims
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    runtime = result.metrics.get("train_runtime") or float("nan")
    return {"final_loss": losses[-1] if losses else None, "eval_loss": metrics["eval_loss"],
            "steps": result.global_step, "tokens_per_s": trainer.wallfacer_metrics.total_tokens / runtime,
            "sequence_parallel_size": dims.sp_size, "mode": dims.mode, "world_size": dims.world_size,
            "output_dir": os.path.abspath(output_dir), **extra}


if __name__ == "__main__":
    sys.exit(main())
