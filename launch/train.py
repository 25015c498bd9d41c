"""Train a small Llama (built from config) with sequence parallelism on the bundled text, via DeepSpeed.

    deepspeed --num_gpus 4 launch/train.py --deepspeed_config ds_configs/hybrid.json

Runs on CPU ranks (gloo) where there is no GPU. Tokenisation is bytes (vocab 256). Logs the loss to stdout and
to wandb (offline unless WANDB_MODE says otherwise); the last line is a JSON summary. Parse, build, train, close.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / "launch" / "data"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", default=str(ROOT / "ds_configs" / "wallfacer.json"),
                   help="ds_config JSON with a \"wallfacer\" section")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (unused: env LOCAL_RANK)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--seq_len", type=int, default=512, help="tokens per sequence (padded to a multiple of 2P)")
    p.add_argument("--data", default=str(DEFAULT_DATA), help="a .txt file or a folder of them")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate when the ds_config has no optimizer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_dir", default=str(ROOT / "runs"), help="wandb files go here")
    p.add_argument("--wandb_project", default="ds_wallfacer")
    p.add_argument("--no_wandb", action="store_true", help="do not log to wandb")
    return p.parse_args(argv)


def load_text(path: str) -> bytes:
    files = sorted(Path(path).glob("*.txt")) if Path(path).is_dir() else [Path(path)]
    if not files:
        raise FileNotFoundError(f"no .txt files under {path}")
    return b"\n".join(f.read_bytes() for f in files)


class ByteWindows(torch.utils.data.Dataset):
    """Non-overlapping windows of ``seq_len`` bytes: map-style, so every data-parallel replica gets its own."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.n = len(ids) // seq_len
        if self.n == 0:
            raise ValueError(f"the text has {len(ids)} bytes, fewer than one sequence of {seq_len}")
        self.windows = ids[: self.n * seq_len].view(self.n, seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.windows[i]


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    cfg = LlamaConfig(
        vocab_size=256, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 256), attn_implementation="wallfacer",
    )
    return LlamaForCausalLM(cfg)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import ds_wallfacer.integration as wfi  # registers attn_implementation="wallfacer"

    from ds_wallfacer.config import parse_ds_config

    model = build_model(args)
    optimizer = None
    if not parse_ds_config(args.deepspeed_config).has_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    # seq_len lets the planner resolve the config's "auto" values for this run's sequences
    engine, sp = wfi.initialize(model=model, config=args.deepspeed_config, optimizer=optimizer, seq_len=args.seq_len)
    rank = torch.distributed.get_rank()
    loader = sp.dataloader(ByteWindows(load_text(args.data), args.seq_len), shuffle=True, seed=args.seed)

    run = None
    if rank == 0 and not args.no_wandb:
        import wandb

        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        run = wandb.init(project=args.wandb_project, dir=args.output_dir, config={
            **vars(args), "layout": sp.layout.describe(), "world_size": sp.layout.world_size})
        run.config.update(sp.layout.log_dict())  # resolved "auto" values, the planner's choice and reasons

    losses: list[float] = []
    step, micro, epoch, t0 = 0, 0, 0, time.time()
    gas = engine.gradient_accumulation_steps()
    while step < args.steps:
        loader.set_epoch(epoch)
        for batch in loader:
            loss = engine(**{k: v.to(engine.device) for k, v in batch.items()})
            engine.backward(loss)
            engine.step()  # DeepSpeed updates only at the accumulation boundary
            micro += 1
            if micro % gas:
                continue
            losses.append(loss.item())
            if rank == 0:
                print(f"step {step} loss {losses[-1]:.4f} ({time.time() - t0:.1f}s)", flush=True)
                if run is not None:
                    run.log({"loss": losses[-1]}, step=step)
            step += 1
            if step >= args.steps:
                break
        epoch += 1
    if rank == 0:
        if run is not None:
            run.finish()
        ok = all(math.isfinite(x) for x in losses)
        print(json.dumps({"steps": step, "first_loss": losses[0], "final_loss": losses[-1], "finite": ok,
                          "mode": sp.layout.mode, "sequence_parallel_size": sp.layout.sp_size,
                          "ulysses_degree": sp.layout.ulysses_degree, "ring_count": sp.layout.ring_count,
                          "placement": sp.layout.placement}), flush=True)
    engine.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
