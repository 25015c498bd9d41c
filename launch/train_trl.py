"""Supervised fine-tuning with TRL's ``SFTTrainer`` and sequence parallelism: the example of
``ds_wallfacer.hf_trainer.WallfacerSFTTrainer``.

    deepspeed --num_gpus 4 launch/train_trl.py --deepspeed_config wallfacer --max_length 1024 --steps 20

A plain TRL script (model, a local chat dataset, ``SFTConfig(deepspeed=...)``, packing, loss on assistant turns
only, evaluation, checkpoints, optionally LoRA) whose one change is ``WallfacerSFTTrainer`` in place of
``SFTTrainer``. ``--data``: a ``.jsonl`` of ``{"messages": [...]}`` conversations (default: the tiny chat set
shipped with the package, ``ds_wallfacer/examples/chat.jsonl``). The model's own tokenizer and chat template
are used when its folder has them, else the byte-level tokenizer with a template that marks assistant turns
(``ds_wallfacer.hf_trainer.chat``). Runs on CPU ranks (gloo) where there is no GPU. The last line printed (rank 0) is
a JSON summary: final_loss, eval_loss, steps, tokens_per_s.
"""
from __future__ import annotations

import argparse
import sys

from ds_wallfacer.examples.hf import (add_run_options, chat_tokenizer, load_example_model, lora_config, print_summary,
                                      resume_argument, run_arguments, start_distributed, trainer_summary)
from ds_wallfacer.hf_trainer.chat import CHAT_DATA, load_chats


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="a preset name, a model folder or a config.json")
    p.add_argument("--data", default=str(CHAT_DATA), help='a .jsonl of {"messages": [...]} conversations')
    p.add_argument("--max_length", type=int, default=512, help="tokens per packed row")
    p.add_argument("--lora_r", type=int, default=0, help="> 0: train a LoRA adapter of this rank (peft)")
    p.add_argument("--eval_size", type=int, default=16, help="conversations held out for evaluation")
    add_run_options(p, output_dir="runs/trl", unit="packed rows")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from datasets import Dataset
    from trl import SFTConfig

    from ds_wallfacer.hf_trainer import WallfacerSFTTrainer
    from ds_wallfacer.integration.ds_runtime import close_distributed

    training = SFTConfig(
        **run_arguments(args), packing=True, eval_packing=False, max_length=args.max_length, assistant_only_loss=True,
        gradient_checkpointing=False,  # layer checkpointing is the ds_config's (mini_sequence) choice here
    )
    start_distributed()
    loaded = load_example_model(args.model, seq_len=args.max_length, seed=training.seed)
    chats = load_chats(args.data)
    if len(chats) <= args.eval_size:
        raise SystemExit(f"--data {args.data} has {len(chats)} conversations: more than --eval_size "
                         f"{args.eval_size} are needed")
    trainer = WallfacerSFTTrainer(model=loaded.model, args=training, processing_class=chat_tokenizer(loaded),
                                  train_dataset=Dataset.from_list(chats[args.eval_size:]),
                                  eval_dataset=Dataset.from_list(chats[: args.eval_size]),
                                  peft_config=lora_config(args.lora_r))
    result = trainer.train(resume_from_checkpoint=resume_argument(args))
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print_summary(trainer_summary(trainer, result, metrics, args.output_dir, lora=args.lora_r > 0))
    close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
