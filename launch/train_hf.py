"""Train with transformers' own ``Trainer`` and sequence parallelism: the example of ``ds_wallfacer.hf_trainer``.

    deepspeed --num_gpus 4 launch/train_hf.py --deepspeed_config wallfacer --seq_len 512 --steps 20

A plain Trainer script (model, local text data, ``TrainingArguments(deepspeed=...)``, evaluation, checkpoints)
whose one change is ``WallfacerTrainer`` in place of ``Trainer``. ``--deepspeed_config``: a shipped example's
name (``ds_wallfacer/examples/configs``) or a path; the Trainer's arguments own the batch sizes, gradient clipping
and learning rate, so the example sets those keys of the config to "auto". Runs on CPU ranks (gloo) where there
is no GPU. The last line printed (rank 0) is a JSON summary: final_loss, eval_loss, steps, tokens_per_s. The run
ends with its process groups destroyed, so every rank exits with status 0 (Note [A clean exit], docs/trainer.md).
"""
from __future__ import annotations

import argparse
import sys

from ds_wallfacer.examples import DATA_DIR
from ds_wallfacer.examples.hf import (add_run_options, load_example_model, print_summary, resume_argument,
                                      run_arguments, start_distributed, token_datasets, trainer_summary)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="a preset name, a model folder or a config.json")
    p.add_argument("--data", default=str(DATA_DIR), help="local text: .txt / .jsonl / .parquet or a folder")
    p.add_argument("--seq_len", type=int, default=256)
    add_run_options(p, output_dir="runs/hf", unit="sequences")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import TrainingArguments, default_data_collator

    from ds_wallfacer.hf_trainer import WallfacerTrainer
    from ds_wallfacer.integration.ds_runtime import close_distributed

    training = TrainingArguments(**run_arguments(args))
    start_distributed()
    loaded = load_example_model(args.model, seq_len=args.seq_len, seed=training.seed)
    train_set, eval_set = token_datasets(args, loaded)
    trainer = WallfacerTrainer(model=loaded.model, args=training, train_dataset=train_set, eval_dataset=eval_set,
                               data_collator=default_data_collator)
    result = trainer.train(resume_from_checkpoint=resume_argument(args))
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print_summary(trainer_summary(trainer, result, metrics, args.output_dir))
    close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
