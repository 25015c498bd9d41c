"""Reinforcement learning with TRL's ``GRPOTrainer`` and sequence parallelism: the example of
``ds_wallfacer.hf_trainer.WallfacerGRPOTrainer``.

    deepspeed --num_gpus 4 launch/train_grpo.py --deepspeed_config wallfacer --filler 8 --steps 20

A plain TRL script (model, prompts, a rule-based reward, ``GRPOConfig(deepspeed=...)``) whose one change is
``WallfacerGRPOTrainer`` in place of ``GRPOTrainer``. The prompts are synthetic and shipped
(``ds_wallfacer.hf_trainer.rl_data``): addition questions, rewarded 1 when the completion's first number is the sum,
0.5 when it starts with a digit; ``--filler K`` puts K context sentences before each question. Each rank generates
its share of the group's completions with the model whole, the group gathers them and trains on them under sequence
parallelism. With ``--lora_r`` and ``--beta`` > 0 the KL is taken to the base model under the adapter. Runs on CPU
ranks (gloo) where there is no GPU.
The last line printed (rank 0) is a JSON summary: final_loss, mean reward of the first and last step, steps,
tokens_per_s, ``rollouts``: per rank of the first group, the prompts, completion tokens and seconds it generated, and
``phases``: per rank of the first group, the seconds of generation, scoring (policy, reference), the rest of the
rollouts and training (``hf_trainer/phases.py``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ds_wallfacer.examples.hf import (chat_tokenizer, load_example_model, lora_config, print_summary, resume_argument,
                                      start_distributed)
from ds_wallfacer.examples.rl import add_rl_options, rl_arguments, rl_seq_len, rl_summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=64, help="prompts to train on")
    p.add_argument("--num_generations", type=int, default=4, help="completions per prompt")
    p.add_argument("--max_completion_length", type=int, default=16)
    p.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 needs --lora_r: the base model is "
                                                           "the reference)")
    p.add_argument("--lora_away_from_base", action="store_true",
                   help="start the LoRA adapter away from the base model (both matrices random): with --beta > 0 the "
                        "KL term trains from the first step, even on greedy completions")
    p.add_argument("--greedy", action="store_true",
                   help="decode greedily (the split rollouts then equal one process generating the whole batch)")
    p.add_argument("--num_iterations", type=int, default=1,
                   help="TRL's num_iterations: optimizer passes over each generation round (> 1: the old policy is "
                        "scored for importance sampling)")
    p.add_argument("--loss_type", default="grpo", help="TRL's GRPO loss type (grpo, dr_grpo, dapo, ...)")
    p.add_argument("--redundant_rollouts", action="store_true",
                   help="every rank of a group generates the group's whole batch (the benchmark's baseline; by "
                        "default each rank generates its share)")
    add_rl_options(p, output_dir="runs/grpo", unit="completions")
    p.set_defaults(micro_batch=4, lr=1e-3)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.beta > 0 and args.lora_r <= 0 and not Path(args.model).is_dir():
        raise SystemExit("--beta > 0 needs a reference model: give --lora_r (the base model is the reference) or "
                         "a model folder (TRL loads the reference from it)")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ds_wallfacer.hf_trainer import WallfacerGRPOTrainer
    from ds_wallfacer.hf_trainer.rl_data import arithmetic_reward, make_prompts
    from ds_wallfacer.integration.ds_runtime import close_distributed

    run, probe = rl_arguments(args)
    run.update(eval_strategy="no", per_device_eval_batch_size=args.micro_batch)
    training = GRPOConfig(**run, beta=args.beta, loss_type=args.loss_type, num_generations=args.num_generations,
                          num_iterations=args.num_iterations,
                          generation_kwargs={"do_sample": False} if args.greedy else None,
                          max_completion_length=args.max_completion_length, gradient_checkpointing=False)
    start_distributed()
    attention = "sdpa" if args.trainer == "trl" else None  # TRL's own trainer attends with the usual kernels
    loaded = load_example_model(args.model, seq_len=rl_seq_len(args), seed=training.seed, attention=attention)
    model = args.model if Path(args.model).is_dir() else loaded.model
    cls = WallfacerGRPOTrainer if args.trainer == "wallfacer" else GRPOTrainer
    trainer = cls(model=model, args=training, processing_class=chat_tokenizer(loaded), reward_funcs=arithmetic_reward,
                  peft_config=lora_config(args.lora_r, away_from_base=args.lora_away_from_base),
                  train_dataset=Dataset.from_list(make_prompts(args.prompts, seed=training.seed, filler=args.filler)))
    if args.measure_step:
        trainer.add_callback(probe.callback())
    if args.redundant_rollouts:
        trainer.redundant_rollouts = True
    result = trainer.train(resume_from_checkpoint=resume_argument(args))
    ours = args.trainer == "wallfacer"
    rollouts, phases = (trainer.rollout_stats(), trainer.phase_stats()) if ours else (None, None)  # collectives
    if trainer.is_world_process_zero():
        rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
        print_summary(rl_summary(trainer, result, {}, args.output_dir, lora=args.lora_r > 0,
                                 first_reward=rewards[0] if rewards else None,
                                 last_reward=rewards[-1] if rewards else None,
                                 activation_bytes=probe.activation_bytes, cuda_peak_bytes=probe.cuda_peak_bytes,
                                 rollouts=rollouts, phases=phases))
    close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
