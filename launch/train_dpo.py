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
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository's package, also when not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_hf import add_run_options, run_arguments  # noqa: E402  (the Trainer example's shared parts)
from train_trl import tokenizer_for  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=96, help="preference pairs to train on")
    p.add_argument("--eval_size", type=int, default=8, help="pairs held out for evaluation")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss_type", default="sigmoid", help="TRL's DPO loss type(s), comma-separated")
    add_rl_options(p, output_dir="runs/dpo", unit="preference pairs")
    return p.parse_args(argv)


def add_rl_options(p: argparse.ArgumentParser, *, output_dir: str, unit: str) -> None:
    """The options the DPO and GRPO examples share, and the Trainer example's (``add_run_options``)."""
    p.add_argument("--model", default="tiny-llama", help="a preset name, a model folder or a config.json")
    p.add_argument("--filler", type=int, default=2, help="context sentences before each question (row length)")
    p.add_argument("--lora_r", type=int, default=0, help="> 0: train a LoRA adapter of this rank (peft)")
    p.add_argument("--trainer", choices=("wallfacer", "trl"), default="wallfacer",
                   help="trl: TRL's own trainer, without sequence parallelism (the benchmark's one-rank reference)")
    p.add_argument("--measure_step", type=int, default=0,
                   help="> 0: the activation bytes of that training step on rank 0 (saved for backward, per "
                        "micro-step; the benchmark's memory figure; not under ZeRO-3)")
    add_run_options(p, output_dir=output_dir, unit=unit)


def rl_summary(trainer, result, metrics: dict, output_dir: str, **extra) -> dict:
    """The last line: the last logged values of ``keys``, the eval loss, steps, tokens per second over all ranks
    (TRL's ``num_tokens``: the batches' real tokens), the layout."""
    import os

    logs = [h for h in trainer.state.log_history if "loss" in h]
    last = logs[-1] if logs else {}
    sp = getattr(trainer, "sequence_parallel", None)  # None: TRL's own trainer (--trainer trl)
    runtime = result.metrics.get("train_runtime") or float("nan")
    return {"final_loss": last.get("loss"), "eval_loss": metrics.get("eval_loss"), "steps": result.global_step,
            "tokens_per_s": (last.get("num_tokens") or 0) / runtime,
            "sequence_parallel_size": sp.setup.dims.sp_size if sp else 1, "mode": sp.setup.dims.mode if sp else None,
            "world_size": trainer.args.world_size, "output_dir": os.path.abspath(output_dir), **extra}


def trainer_setup(args: argparse.Namespace) -> tuple[dict, object]:
    """The trainer's arguments from the shared options (TRL's own trainer: the ds_config without its
    ``"wallfacer"`` section) and the step-memory probe (``--measure_step``)."""
    from ds_wallfacer.hf_trainer.metrics import StepActivationBytes

    run = run_arguments(args)
    if args.measure_step and (run["deepspeed"].get("zero_optimization") or {}).get("stage") == 3:
        raise SystemExit("--measure_step reads the tensors autograd saves, which hands ZeRO-3's gathered parameters "
                         "back without their ZeRO attributes: measure under ZeRO stage 0-2")
    if args.trainer == "trl":
        run["deepspeed"] = {k: v for k, v in run["deepspeed"].items() if k != "wallfacer"}
    return run, StepActivationBytes(args.measure_step)



def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from datasets import Dataset
    from trl import DPOConfig

    from trl import DPOTrainer

    from ds_wallfacer.hf_trainer import WallfacerDPOTrainer
    from ds_wallfacer.hf_trainer.rl_data import make_preferences
    from ds_wallfacer.train.model import load_model

    run, probe = trainer_setup(args)
    training = DPOConfig(**run, beta=args.beta, loss_type=args.loss_type.split(","),
                         gradient_checkpointing=False)  # layer checkpointing is the ds_config's choice here
    import deepspeed

    # ZeRO-3 builds the model partitioned (zero.Init), sized by DeepSpeed's world: start it first
    deepspeed.init_distributed()
    seq_len = 64 * (args.filler + 2)
    loaded = load_model(args.model, seq_len=seq_len, dtype=torch.float32, seed=training.seed)
    if args.trainer == "trl":  # TRL's own trainer attends with the model's usual kernels
        loaded.model.set_attn_implementation("sdpa")
    pairs = make_preferences(args.pairs + args.eval_size, seed=training.seed, filler=args.filler)
    kwargs = {}
    if args.lora_r > 0:
        from peft import LoraConfig

        kwargs["peft_config"] = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                                           target_modules="all-linear")
    else:  # the initial policy, loaded again
        kwargs["ref_model"] = load_model(args.model, seq_len=seq_len, dtype=torch.float32, seed=training.seed).model
        kwargs["ref_model"].set_attn_implementation(loaded.model.config._attn_implementation)
    cls = WallfacerDPOTrainer if args.trainer == "wallfacer" else DPOTrainer
    trainer = cls(model=loaded.model, args=training, processing_class=tokenizer_for(loaded),
                  train_dataset=Dataset.from_list(pairs[args.eval_size:]),
                  eval_dataset=Dataset.from_list(pairs[: args.eval_size]), **kwargs)
    if args.measure_step:
        trainer.add_callback(probe.callback())
    resume = True if args.resume == "last" else args.resume
    result = trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        last = [h for h in trainer.state.log_history if "rewards/accuracies" in h][-1]
        print(json.dumps(rl_summary(trainer, result, metrics, args.output_dir, lora=args.lora_r > 0,
                                    reward_accuracy=last["rewards/accuracies"], reward_margin=last["rewards/margins"],
                                    eval_reward_accuracy=metrics.get("eval_rewards/accuracies"),
                                    activation_bytes=probe.activation_bytes,
                                    cuda_peak_bytes=probe.cuda_peak_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
