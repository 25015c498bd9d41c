"""The baseline of ``bench_hf_trainer.py``: transformers' ``Trainer`` with DeepSpeed's own Ulysses (ALST), as its
users switch it on: accelerate's ``ParallelismConfig(sp_backend="deepspeed", sp_size=N)`` with SDPA as the core
attention, ``position_ids`` in every batch. Same model (preset, seeded), data (the text corpus cut as
``launch/train_hf.py`` cuts it, ``train.data.token_rows``), arguments and ds_config (its ``"wallfacer"`` section
dropped) as the example it is compared with.

    deepspeed --num_gpus 4 benchmarks/hf_trainer_alst.py --deepspeed_config ulysses --seq_len 1024 --steps 8

Prints the example's JSON summary line last (final_loss, steps, tokens_per_s; no evaluation).
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``launch/train_hf.py``'s options that matter here (the others, e.g. ``--eval_steps``, are ignored)."""
    from ds_wallfacer import examples

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny-llama")
    p.add_argument("--data", default=str(examples.DATA_DIR))
    p.add_argument("--deepspeed_config", default="ulysses")
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--output_dir", default="runs/hf_alst")
    return p.parse_known_args(argv)[0]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import deepspeed
    import torch
    import torch.distributed as dist
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    from ds_wallfacer.examples import trainer_config
    from ds_wallfacer.integration.ds_runtime import close_distributed, release_shm_buffer
    from ds_wallfacer.train.data import token_rows
    from ds_wallfacer.train.model import BYTE_EOS_ID, PRESETS, byte_tokenizer

    cfg = trainer_config(args.deepspeed_config)
    cfg.pop("wallfacer", None)
    deepspeed.init_distributed()
    sp = dist.get_world_size()
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr, logging_steps=1,
        save_strategy="no", report_to=[], deepspeed=cfg, disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
        parallelism_config=ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp,
            sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="sdpa")),
    )
    values = copy.deepcopy(PRESETS[args.model])
    torch.manual_seed(training.seed)  # the example's weights (load_model seeds the same way)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(values.pop("model_type"), **values),
                                             attn_implementation="sdpa")
    train_set, _ = token_rows(args.data, byte_tokenizer(), tokenizer_id="bytes", eos_id=BYTE_EOS_ID,
                              seq_len=args.seq_len, cache_dir=Path(args.output_dir) / "cache")
    # position ids in every batch, as ALST needs; the set repeated so that its loader adapter (which hands every rank
    # each peer's batches in turn) does not end the epoch, and the run, before --steps
    train_set = [{**r, "position_ids": list(range(len(r["input_ids"])))} for r in train_set] * sp
    trainer = Trainer(model=model, args=training, train_dataset=train_set, data_collator=default_data_collator)
    dist.barrier()
    release_shm_buffer()
    result = trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tokens = result.global_step * args.micro_batch * args.grad_accum * args.seq_len  # one sequence group: P ranks
    if trainer.is_world_process_zero():
        print(json.dumps({"final_loss": losses[-1] if losses else None, "eval_loss": None,
                          "steps": result.global_step, "tokens_per_s": tokens / result.metrics["train_runtime"],
                          "sequence_parallel_size": sp, "mode": "alst", "world_size": sp}))
    close_distributed()  # Note [A clean exit] (docs/trainer.md): the plain Trainer destroys no group
    return 0


if __name__ == "__main__":
    sys.exit(main())
