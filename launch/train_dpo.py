"""Preference training with TRL's ``DPOTrainer`` and sequence parallelism: the example of
``ds_wallfacer.hf_trainer.WallfacerDPOTrainer``.

    deepspeed --num_gpus 4 launch/train_dpo.py --deepspeed_config wallfacer --filler 8 --steps 20

A plain TRL script (model, preference pairs, ``DPOConfig(deepspeed=...)``, a reference model, evaluation, optionally
LoRA) whose one change is ``WallfacerDPOTrainer`` in place of ``DPOTrainer``. The data is synthetic and shipped
(``ds_wallfacer.hf_trainer.rl_data``): an addition question, the right sum chosen, a wrong one rejected;
``--filler K`` puts K context sentences before each question (longer rows). The reference is a second copy of the
initial model, or, with ``--lora_r``, the base model under the adapter. Runs on CPU ranks (gloo) where there is no
GPU. The last line printed (rank 0) is a JSON summary: final_loss, eval_loss, reward accuracy and margin, steps,
tokens_per_s.
"""
from __future__ import annotations

import argparse
import sys

from ds_wallfacer.examples.hf import (chat_tokenizer, load_example_model, lora_config, print_summary, resume_argument,
                                      start_distributed)
from ds_wallfacer.examples.rl import add_rl_options, rl_arguments, rl_seq_len, rl_summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=96, help="preference pairs to train on")
    p.add_argument("--eval_size", type=int, default=8, help="pairs held out for evaluation")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss_type", default="sigmoid", help="TRL's DPO loss type(s), comma-separated")
    add_rl_options(p, output_dir="runs/dpo", unit="preference pairs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    from ds_wallfacer.hf_trainer import WallfacerDPOTrainer
    from ds_wallfacer.hf_trainer.rl_data import make_preferences
    from ds_wallfacer.integration.ds_runtime import close_distributed

    run, probe = rl_arguments(args)
    training = DPOConfig(**run, beta=args.beta, loss_type=args.loss_type.split(","),
                         gradient_checkpointing=False)  # layer checkpointing is the ds_config's choice here
    start_distributed()
    attention = "sdpa" if args.trainer == "trl" else None  # TRL's own trainer attends with the usual kernels
    loaded = load_example_model(args.model, seq_len=rl_seq_len(args), seed=training.seed, attention=attention)
    pairs = make_preferences(args.pairs + args.eval_size, seed=training.seed, filler=args.filler)
    kwargs = {"peft_config": lora_config(args.lora_r)}
    if args.lora_r <= 0:  # the reference: the initial policy, loaded again (with LoRA: the base model)
        kwargs["ref_model"] = load_example_model(args.model, seq_len=rl_seq_len(args), seed=training.seed,
                                                 attention=loaded.model.config._attn_implementation).model
    cls = WallfacerDPOTrainer if args.trainer == "wallfacer" else DPOTrainer
    trainer = cls(model=loaded.model, args=training, processing_class=chat_tokenizer(loaded),
                  train_dataset=Dataset.from_list(pairs[args.eval_size:]),
                  eval_dataset=Dataset.from_list(pairs[: args.eval_size]), **kwargs)
    if args.measure_step:
        trainer.add_callback(probe.callback())
    result = trainer.train(resume_from_checkpoint=resume_argument(args))
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        last = [h for h in trainer.state.log_history if "rewards/accuracies" in h][-1]
        print_summary(rl_summary(trainer, result, metrics, args.output_dir, lora=args.lora_r > 0,
                                 reward_accuracy=last["rewards/accuracies"], reward_margin=last["rewards/margins"],
                                 eval_reward_accuracy=metrics.get("eval_rewards/accuracies"),
                                 activation_bytes=probe.activation_bytes, cuda_peak_bytes=probe.cuda_peak_bytes))
    close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
