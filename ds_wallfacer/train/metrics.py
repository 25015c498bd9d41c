"""What a run reports: throughput, model FLOP/s and MFU, peak memory, bytes sent, and the wandb run.

Model FLOPs per optimizer step (forward + backward, recomputation not counted):

    6 * params * tokens  +  6 * layers * q_heads * head_dim * seq_len^2 * sequences

MFU = model FLOP/s / (world size x the accelerator's dense peak for the training dtype, ``PEAK_TFLOPS``).

Design: Note [Model FLOPs and MFU] in docs/design/dependencies.md; Note [wandb beside DeepSpeed] in
docs/design/training.md.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["PEAK_TFLOPS", "comm_bytes", "gather_rows", "init_wandb", "log_step", "model_flops_per_step",
           "peak_memory_bytes", "peak_tflops", "replica_mean", "run_summary", "split_wandb_section"]

PEAK_TFLOPS: dict[str, dict[torch.dtype, float]] = {
    "H100": {torch.bfloat16: 989.0, torch.float16: 989.0},
    "H200": {torch.bfloat16: 989.0, torch.float16: 989.0},
    "A100": {torch.bfloat16: 312.0, torch.float16: 312.0},
}
"""Dense peak TFLOP/s per device by name fragment and dtype (vendor figures, no sparsity)."""


def peak_tflops(dtype: torch.dtype) -> float | None:
    """This accelerator's dense peak for ``dtype``, or None when unknown (CPU, another GPU, fp32)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name().upper()
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            return table.get(dtype)
    return None


def model_flops_per_step(*, params: int, layers: int, q_heads: int, head_dim: int, seq_len: int,
                         sequences: int) -> float:
    """Model FLOPs of one optimizer step over ``sequences`` sequences of ``seq_len`` tokens (formula above)."""
    tokens = sequences * seq_len
    return 6.0 * params * tokens + 6.0 * layers * q_heads * head_dim * seq_len * seq_len * sequences


def peak_memory_bytes() -> int:
    """CUDA max allocated on this rank's device, else this process's peak resident set size."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB


def comm_bytes(sent: Any) -> dict[str, int]:
    """``CommLayer.sent`` ({(phase, kind): bytes}) -> {"comm/<phase>/<kind>": bytes} plus ``comm/total``."""
    out = {f"comm/{phase}/{kind}": int(n) for (phase, kind), n in sorted(sent.items())}
    out["comm/total"] = int(sum(sent.values()))
    return out


def split_wandb_section(ds_config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ds_config without ``"wandb"``, the section or {})."""
    cfg = dict(ds_config)
    section = cfg.pop("wandb", None) or {}
    return cfg, dict(section)


def init_wandb(*, output_dir: Path, section: dict[str, Any], project: str | None, name: str | None,
               config: dict[str, Any]) -> Any:
    """Start the run (rank 0). WANDB_MODE is respected; offline when unset."""
    os.environ.setdefault("WANDB_MODE", "offline")
    import wandb

    output_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(
        project=project or section.get("project") or "ds_wallfacer", group=section.get("group"),
        entity=section.get("team"), name=name, dir=str(output_dir), config=config,
    )
    return run


def gather_rows(values: torch.Tensor, *, comm: Any) -> torch.Tensor:
    """[k] on every rank -> [W, k] on the host, every rank's row. Through the comm layer, which checks the tensor
    is on the group's device."""
    with comm.phase("metrics"):
        return comm.all_gather(values, dist.group.WORLD).cpu()


def replica_mean(rows: torch.Tensor, *, dims: Any) -> torch.Tensor:
    """[W, k] rows equal within a sequence-parallel group -> their mean over the data-parallel replicas, in float64
    (one value per replica, so D = 1 returns the value exactly)."""
    firsts = [rows[dims.sp_ranks(d)[0]] for d in range(dims.dp_size)]
    return torch.stack(firsts).double().mean(0)


def log_step(values: dict[str, Any], *, log_file: Path, wandb_run: Any, bar: Any) -> None:
    """One step's ``values``: a line of ``log_file`` (``metrics.jsonl``), wandb (when ``wandb_run``), and the
    step's line on stdout (through the progress ``bar`` if any)."""
    with open(log_file, "a") as f:
        f.write(json.dumps(values) + "\n")
    if wandb_run is not None:
        wandb_run.log({k: v for k, v in values.items() if k != "step"}, step=values["step"])
    loss_v, lr, dt = values["loss"], values["lr"], values["step_time_s"]
    line = f"step {values['step']} loss {loss_v:.4f} lr {lr:.2e} {values['tokens_per_s']:.0f} tok/s {dt:.2f}s"
    if "eval_loss" in values:
        line += f" eval_loss {values['eval_loss']:.4f}"
    if "skipped" in values:
        line += f" skipped: {values['skipped']}"
    if bar is not None:
        bar.set_postfix(loss=f"{loss_v:.4f}", tok_s=f"{values['tokens_per_s']:.0f}",
                        mem=f"{values['peak_memory_bytes'] / 2**30:.2f}GiB")
        bar.update(1)
        bar.write(line, file=sys.stdout)
    else:
        print(line, flush=True)


def run_summary(t: Any, exported: Path | None) -> dict[str, Any]:
    """The trainer ``t``'s last line (rank 0), as a dict; closes its wandb run."""
    args, setup, losses = t.args, t.setup, t.losses
    dims = setup.dims
    measured = statistics.median(t.step_times) if t.step_times else None
    predicted = (setup.planner_choice or {}).get("step_s")
    summary = {
        "steps": t.step, "steps_this_run": len(losses), "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None, "eval_loss": t.eval_loss,
        "finite": all(math.isfinite(x) for x in losses),
        # tokens per step are fixed unless dynamic sequence parallelism trains rows of their own lengths
        "tokens_per_s": statistics.median(t.step_tokens) / measured if measured else None, "wall_s": t.wall_s,
        "measured_step_s": measured, "predicted_step_s": predicted, "mode": dims.mode,
        "sequence_parallel_size": dims.sp_size, "data_parallel_size": dims.dp_size,
        "ulysses_degree": dims.ulysses_degree, "ring_count": dims.ring_count, "placement": dims.placement,
        "world_size": t.world, "seq_len": args.seq_len, "params": t.n_params,
        "dtype": str(t.dtype).replace("torch.", ""), "global_batch": t.seq_per_step,
        "train_sequences": len(t.data.train), "eval_sequences": len(t.data.eval),
        "mini_sequence": t.sp.mini_sequence is not None, "skipped_steps": t.nonfinite.skipped,
        "stopped": t.stopped,
        "resumed_from": str(t.resume_tag) if t.resume_tag else None,
        "checkpoint": str(t.last_ckpt) if t.last_ckpt else None,
        "export_dir": str(exported) if exported else None, "metrics": str(t.log_file), "wandb_dir": None,
    }
    if t.wandb_run is not None:
        t.wandb_run.summary.update({"measured_step_s": measured, "predicted_step_s": predicted})
        summary["wandb_dir"] = str(Path(t.wandb_run.dir).parent)
        t.wandb_run.finish()
    return summary
