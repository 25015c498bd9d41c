"""A vision-language model with images under sequence parallelism: the example of ``ds_wallfacer.integration`` with
Qwen2.5-VL / Qwen3-VL.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 launch/train_vlm.py                  # 4 CPU ranks (gloo)
    deepspeed --num_gpus 8 launch/train_vlm.py --family qwen3_vl --deepspeed_config hybrid --packed

The usual loop (``initialize``, ``sp.dataloader``, ``engine(**batch)``); the batches are what a Qwen processor's
collator gives: ``input_ids`` with each image as ``<vision_start> <image> x k <vision_end>``, ``pixel_values``,
``image_grid_thw`` and ``mm_token_type_ids``. The data is synthetic and generated (``ds_wallfacer.examples.vlm``: text
tokens with ``--images`` random images of different shapes per conversation), the model a tiny one built from its
config (``--family``), or ``--model`` a Qwen-VL folder for ``from_pretrained``. ``--packed`` packs each micro-batch's
conversations into one row of documents. The group splits the vision tower's work by frames; the language model runs
on this rank's shard. Logs to wandb (offline unless ``WANDB_MODE`` says otherwise) with ``--wandb``. The last
line printed (rank 0) is a JSON summary: first and final loss, steps, tokens and image tokens per step, tokens/s, this
rank's sequence-parallel bytes per step (attention and loss; the image features' all-gather apart, "vision") and the
batch's pixel bytes (every rank receives them; each encodes its share of the frames).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--family", default="qwen2_5_vl", choices=("qwen2_5_vl", "qwen3_vl", "qwen2_vl", "qwen3_vl_moe"),
                   help="the tiny model built from its config")
    p.add_argument("--model", default=None, help="a Qwen-VL folder for from_pretrained (instead of --family)")
    p.add_argument("--deepspeed_config", default="wallfacer",
                   help="a ds_config path or a shipped example's name (ds_configs/)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch_size", type=int, default=2, help="conversations per micro-batch")
    p.add_argument("--text", type=int, default=200, help="text tokens per conversation")
    p.add_argument("--images", type=int, default=2, help="images per conversation")
    p.add_argument("--image_side", type=int, default=6, help="merged patches per image side (tokens: side^2)")
    p.add_argument("--packed", action="store_true", help="pack each micro-batch into one row of documents")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--wandb", action="store_true", help="log to wandb (offline by default)")
    p.add_argument("--output_dir", default="runs/vlm")
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")
    import deepspeed
    import torch
    import torch.distributed as dist

    import ds_wallfacer.integration as wf
    from ds_wallfacer.examples import find_config
    from ds_wallfacer.examples.vlm import IMAGE, conversation_batch, example_conversations, example_vlm
    from ds_wallfacer.integration.ds_runtime import close_distributed

    deepspeed.init_distributed()
    config = json.loads(Path(find_config(args.deepspeed_config) or args.deepspeed_config).read_text())
    config["train_micro_batch_size_per_gpu"] = 1
    model = example_vlm(args.family, path=args.model)
    engine, sp = wf.initialize(model=model, config=config,
                               optimizer=torch.optim.AdamW(model.parameters(), lr=args.lr))
    dims = sp.setup.dims
    micro = args.batch_size
    rows = example_conversations(model, args.steps * dims.dp_size * micro, text=args.text, images=args.images,
                                 side=args.image_side)
    batches = [conversation_batch(rows[i:i + micro], packed=args.packed) for i in range(0, len(rows), micro)]
    run = None
    if args.wandb and dist.get_rank() == 0:
        import wandb

        run = wandb.init(project="ds_wallfacer", name=f"vlm-{args.family}", dir=args.output_dir,
                         config={**vars(args), **dims.__dict__})
    losses, times, sp_bytes, vision_bytes = [], [], [], []
    for batch in sp.dataloader(batches):
        sp.comm.reset()
        t0 = time.perf_counter()
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        sp_bytes.append(sum(b for (phase, _), b in sp.comm.sent.items() if phase in ("forward", "backward")))
        vision_bytes.append(sum(b for (phase, _), b in sp.comm.sent.items() if phase == "vision"))
        if run is not None:
            run.log({"loss": losses[-1], "step_s": times[-1]})
    tokens = sum(int(b["input_ids"].numel()) for b in batches) // len(batches)
    image_tokens = sum(int((b["input_ids"] == IMAGE).sum()) for b in batches) // len(batches)
    pixel_bytes = sum(int(b["pixel_values"].numel() * b["pixel_values"].element_size()) for b in batches) // len(batches)
    steady = sorted(times[1:] or times)[len(times[1:] or times) // 2]
    summary = {
        "family": args.family if not args.model else args.model, "mode": dims.mode, "sequence_parallel": dims.sp_size,
        "data_parallel": dims.dp_size, "steps": len(losses), "first_loss": losses[0], "final_loss": losses[-1],
        "tokens_per_step": tokens * dims.dp_size, "image_tokens_per_step": image_tokens * dims.dp_size,
        "tokens_per_s": tokens * dims.dp_size / steady, "sp_bytes_per_step": int(sorted(sp_bytes)[len(sp_bytes) // 2]),
        "vision_bytes_per_step": int(sorted(vision_bytes)[len(vision_bytes) // 2]), "pixel_bytes_per_step": pixel_bytes,
    }
    if run is not None:
        run.summary.update(summary)
        run.finish()
    engine.destroy()
    if dist.get_rank() == 0:
        print(json.dumps(summary), flush=True)
    close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
