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
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's package, also when not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_hf import add_run_options, run_arguments, summary  # noqa: E402  (the Trainer example's shared parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ds_wallfacer.hf_trainer.chat import CHAT_DATA

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama", help="a preset name, a model folder or a config.json")
    p.add_argument("--data", default=str(CHAT_DATA), help='a .jsonl of {"messages": [...]} conversations')
    p.add_argument("--max_length", type=int, default=512, help="tokens per packed row")
    p.add_argument("--lora_r", type=int, default=0, help="> 0: train a LoRA adapter of this rank (peft)")
    p.add_argument("--eval_size", type=int, default=16, help="conversations held out for evaluation")
    add_run_options(p, output_dir="runs/trl", unit="packed rows")
    return p.parse_args(argv)


def tokenizer_for(loaded) -> object:
    """The model folder's tokenizer when it has a chat template, else the example's byte-level chat tokenizer."""
    from ds_wallfacer.hf_trainer.chat import chat_tokenizer

    tok = loaded.tokenizer
    if getattr(tok, "chat_template", None):
        return tok
    return chat_tokenizer()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from datasets import Dataset
    from trl import SFTConfig

    from ds_wallfacer.hf_trainer.chat import load_chats
    from ds_wallfacer.hf_trainer import WallfacerSFTTrainer
    from ds_wallfacer.train.model import load_model

    training = SFTConfig(
        **run_arguments(args), packing=True, eval_packing=False, max_length=args.max_length, assistant_only_loss=True,
        gradient_checkpointing=False,  # layer checkpointing is the ds_config's (mini_sequence) choice here
    )
    import deepspeed

    # ZeRO-3 builds the model partitioned (zero.Init), sized by DeepSpeed's world: start it first (on GPUs the
    # SFTConfig would; with use_cpu it does not)
    deepspeed.init_distributed()
    loaded = load_model(args.model, seq_len=args.max_length, dtype=torch.float32, seed=training.seed)
    chats = load_chats(args.data)
    if len(chats) <= args.eval_size:
        raise SystemExit(f"--data {args.data} has {len(chats)} conversations: more than --eval_size "
                         f"{args.eval_size} are needed")
    peft_config = None
    if args.lora_r > 0:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                 target_modules="all-linear")
    trainer = WallfacerSFTTrainer(model=loaded.model, args=training, processing_class=tokenizer_for(loaded),
                                  train_dataset=Dataset.from_list(chats[args.eval_size:]),
                                  eval_dataset=Dataset.from_list(chats[: args.eval_size]), peft_config=peft_config)
    resume = True if args.resume == "last" else args.resume
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(json.dumps(summary(trainer, result, metrics, args.output_dir, lora=args.lora_r > 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
