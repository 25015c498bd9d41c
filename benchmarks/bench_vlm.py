"""What images add to a sequence-parallel step: rows of the same length with 0 %, 25 % and 50 % image tokens, side by
side in one run on the same ranks.

    python benchmarks/bench_vlm.py                      # 4 CPU ranks (gloo), about a minute
    python benchmarks/bench_vlm.py --tokens 2048 --ranks 4 --steps 4

Each configuration trains a tiny Qwen2.5-VL (``examples.vlm``; WallFacer C = 2 over P = 4, ZeRO-2, SGD) on rows of
``--tokens`` tokens: text only, or with images of 8 x 8 merged patches (64 tokens each) making up that share of the
row. Per configuration: sequence-parallel bytes per step of attention and loss (every rank, forward and backward,
through the counted comm layer; ZeRO's traffic is the same in all and not counted), the bytes the images add (the
all-gather of the features the ranks encoded, and its reduce-scatter in backward: phase "vision"), bytes of
``pixel_values`` in the batch (every rank receives them; each encodes its share), rank 0's vision-tower share of the
step (its forward, timed), the step time
(median after a warm-up, slowest rank) and the mean loss. The last line is one JSON object, also written to
``runs/bench/vlm/result.json`` (``--out``) beside the plot.
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import add_out_option, emit, plot_path, print_table, run_ranks, save_plot  # first: repository on path

import torch

SIDE = 8
"""Merged patches per image side: 64 tokens per image."""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per row (text + image placeholders)")
    ap.add_argument("--shares", type=float, nargs="+", default=[0.0, 0.25, 0.5], help="image token shares")
    ap.add_argument("--steps", type=int, default=4, help="steps per configuration (the first is a warm-up)")
    add_out_option(ap, "vlm")
    return ap.parse_args()


def _row(model, tokens: int, share: float, seed: int) -> dict:
    from ds_wallfacer.examples.vlm import conversation, conversation_batch

    images = int(tokens * share) // (SIDE * SIDE)
    text = tokens - images * (SIDE * SIDE + 2)
    return conversation_batch([conversation(model, text=text, images=[(SIDE, SIDE)] * images, seed=seed)])


def _measure(rank: int, world: int, args: argparse.Namespace) -> list[dict]:
    import torch.distributed as dist

    import ds_wallfacer.integration as wf
    from ds_wallfacer.examples.vlm import tiny_vlm

    out = []
    for share in args.shares:
        model = tiny_vlm("qwen2_5_vl")
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 2},
                  "zero_allow_untested_optimizer": True,
                  "wallfacer": {"mode": "wallfacer", "ring_count": 2, "sequence_parallel_size": world}}
        engine, sp = wf.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        tower = {"s": 0.0}
        visual = model.model.visual
        visual.register_forward_pre_hook(lambda m, a: tower.__setitem__("t0", time.perf_counter()))
        visual.register_forward_hook(lambda m, a, o: tower.__setitem__("s", tower["s"] + time.perf_counter()
                                                                        - tower["t0"]))
        steps, losses = [], []
        for step in range(args.steps):
            batch = sp.shard(_row(model, args.tokens, share, seed=step))
            sp.comm.reset()
            tower["s"] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            loss = engine(**batch)
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - t0
            sent = sum(b for (phase, _), b in sp.comm.sent.items() if phase in ("forward", "backward"))
            vision = sum(b for (phase, _), b in sp.comm.sent.items() if phase == "vision")
            steps.append({"s": elapsed, "sp_bytes": sent, "vision_bytes": vision, "tower_s": tower["s"],
                          "pixel_bytes": int(batch["pixel_values"].numel() * 4) if "pixel_values" in batch else 0})
            losses.append(loss.item())
        engine.destroy()
        out.append({"share": share, "steps": steps[1:] or steps, "loss": statistics.mean(losses)})
    return out


def main() -> None:
    args = parse()
    per_rank = run_ranks(_measure, args.ranks, args, timeout_s=1800)
    if per_rank is None:
        return
    rows = []
    for i, share in enumerate(args.shares):
        runs = [r[i] for r in per_rank]
        step_s = statistics.median(max(r["steps"][k]["s"] for r in runs) for k in range(len(runs[0]["steps"])))
        sp_bytes = statistics.median(sum(r["steps"][k]["sp_bytes"] for r in runs) for k in range(len(runs[0]["steps"])))
        tower = statistics.median(s["tower_s"] for s in runs[0]["steps"])
        vision = statistics.median(sum(r["steps"][k]["vision_bytes"] for r in runs)
                                   for k in range(len(runs[0]["steps"])))
        rows.append({"image_share": share, "sp_bytes_per_step": int(sp_bytes), "vision_bytes_per_step": int(vision),
                     "pixel_bytes_per_rank": runs[0]["steps"][0]["pixel_bytes"], "tower_share": tower / step_s,
                     "step_s": step_s, "loss": runs[0]["loss"]})
    base = rows[0]["sp_bytes_per_step"] or 1
    print_table([("image tokens", ".0%"), ("attention+loss bytes/step", ",d"), ("x text", ".3f"),
                 ("vision bytes/step", ",d"), ("+ share", ".1%"), ("pixel bytes/rank", ",d"),
                 ("tower share", ".1%"), ("step s", ".3f"), ("loss", ".5f")],
                [(r["image_share"], r["sp_bytes_per_step"], r["sp_bytes_per_step"] / base,
                  r["vision_bytes_per_step"], r["vision_bytes_per_step"] / r["sp_bytes_per_step"],
                  r["pixel_bytes_per_rank"], r["tower_share"], r["step_s"], r["loss"]) for r in rows],
                title=f"tiny Qwen2.5-VL, {args.tokens} tokens per row, {args.ranks} ranks (WallFacer C = 2, ZeRO-2)")

    def draw(plt):
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
        shares = [100 * r["image_share"] for r in rows]
        ax[0].bar([str(int(s)) for s in shares], [r["sp_bytes_per_step"] / 2**20 for r in rows])
        ax[0].set(xlabel="image tokens (%)", ylabel="SP MiB / step", title="sequence-parallel traffic")
        ax[1].bar([str(int(s)) for s in shares], [r["vision_bytes_per_step"] / 2**20 for r in rows])
        ax[1].set(xlabel="image tokens (%)", ylabel="MiB / step", title="image features gathered")
        return fig

    save_plot(plot_path(args), draw)
    emit({"bench": "vlm", "rows": rows, "args": {k: str(v) for k, v in vars(args).items()}},
         args.out / "result.json")


if __name__ == "__main__":
    main()
