"""The trainer: parse, build, (resume), train with evaluation and checkpoints, export, summarise.

Start-up order, chosen so that every refusal happens on every rank before any training, and those that need no
process group happen before one exists: options and paths (``cli``), ds_config (pure parse), the checkpoint to
resume (pure: file system), model and tokenizer (position limit, vocabulary), tokenised data (empty data),
``initialize`` (layout, groups, DeepSpeed), then the data-parallel size check and the checkpoint load.

The printed and logged loss of a step is the global token-mean loss of its micro-batches, averaged over the
gradient-accumulation micro-steps and the data-parallel replicas (every sequence is full, so this is the token
mean over the whole global batch).
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ..hf_config import text_config
from . import checkpoint as ckpt
from .cli import StartupError, parse_args
from .data import eval_batches, load_token_data, train_batches
from .export import export_hf
from .metrics import comm_bytes, init_wandb, model_flops_per_step, peak_memory_bytes, peak_tflops, split_wandb_section
from .model import dtype_of, load_model
from .watchdog import start_watchdog

__all__ = ["lr_factor", "main", "run"]


def lr_factor(*, steps: int, warmup_steps: int, decay: str, min_ratio: float) -> Callable[[int], float]:
    """Learning-rate multiplier by optimizer step: linear warm-up, then cosine / linear decay to ``min_ratio``
    at ``steps`` (or constant)."""

    def factor(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / warmup_steps
        if decay == "constant":
            return 1.0
        frac = min(1.0, (s - warmup_steps) / max(1, steps - warmup_steps))
        if decay == "cosine":
            return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1 - (1 - min_ratio) * frac

    return factor


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ds_wallfacer.train`` and ``launch/train.py``: 0 on success, 2 on a refusal."""
    try:
        return run(parse_args(argv))
    except StartupError as e:
        # the same refusal on every rank (each found it itself): one line per node, not one per rank
        if os.environ.get("LOCAL_RANK", "0") in ("0", "-1"):
            print(f"ds_wallfacer.train: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the watchdog handles it: one line per rank, not a traceback
        print(f"ds_wallfacer.train: rank {os.environ.get('RANK', '?')}: interrupted", file=sys.stderr, flush=True)
        return 130


def _read_ds_config(path: str) -> dict[str, Any]:
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise StartupError(f"--deepspeed_config {path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise StartupError(f"--deepspeed_config {path!r} must hold a JSON object")
    return raw


def _replica_mean(values: torch.Tensor, *, layout: Any, comm: Any) -> torch.Tensor:
    """[k] on every rank (equal within a sequence-parallel group) -> their mean over the data-parallel replicas,
    in float64 (one value per replica, so D = 1 returns the value exactly). Through the comm layer, which checks
    the tensor is on the group's device."""
    with comm.phase("metrics"):
        rows = comm.all_gather(values, dist.group.WORLD)  # [W, k]
    firsts = [rows[layout.dims.sp_ranks(d)[0]] for d in range(layout.dims.dp_size)]
    return torch.stack(firsts).double().mean(0).cpu()


def run(args: Any) -> int:
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never a hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import ds_wallfacer.integration as wfi  # registers attn_implementation="wallfacer"

    from ..config import parse_ds_config

    ds_config, wandb_section = split_wandb_section(_read_ds_config(args.deepspeed_config))
    try:
        run_cfg = parse_ds_config(ds_config)
    except ValueError as e:  # a bad "wallfacer" section or batch size: one line on every rank
        raise StartupError(f"--deepspeed_config {args.deepspeed_config!r}: {e}") from None
    out = Path(args.output_dir)
    resume_tag = ckpt.resolve_resume(args.resume, out)
    dtype = dtype_of(run_cfg.deepspeed)
    loaded = load_model(args.model, seq_len=args.seq_len, dtype=dtype, seed=args.seed)
    model = loaded.model
    data = load_token_data(
        args.data, loaded.tokenizer, tokenizer_id=loaded.tokenizer_id, eos_id=loaded.eos_id, seq_len=args.seq_len,
        eval_fraction=args.eval_fraction, text_field=args.text_field, cache_dir=args.cache_dir or out / "token_cache",
    )
    text_cfg = text_config(model)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = None
    if not run_cfg.has_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    scheduler = None
    if "scheduler" not in ds_config:  # else DeepSpeed builds the configured one
        factor = lr_factor(steps=args.steps, warmup_steps=args.warmup_steps, decay=args.lr_decay,
                           min_ratio=args.min_lr_ratio)

        def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
            return torch.optim.lr_scheduler.LambdaLR(opt, factor)  # DeepSpeed calls this with its optimizer

    world_now = int(os.environ.get("WORLD_SIZE", "1"))
    universal = resume_tag is not None and ckpt.saved_world_size(resume_tag) != world_now
    if universal:  # written by another number of ranks: DeepSpeed's universal checkpoint re-partitions ZeRO state
        ds_config = {**ds_config, "checkpoint": {**(ds_config.get("checkpoint") or {}), "load_universal": True}}
    try:
        engine, sp = wfi.initialize(model=model, config=ds_config, optimizer=optimizer, lr_scheduler=scheduler,
                                    seq_len=args.seq_len)
    except ValueError as e:  # a layout the model does not fit, or a model refused by the audit or the self-check
        if dist.is_initialized():
            dist.destroy_process_group()
        raise StartupError(str(e)) from None
    rank, world, lay = dist.get_rank(), dist.get_world_size(), sp.setup
    micro, gas, dp = run_cfg.micro_batch(dp_size=lay.dims.dp_size), engine.gradient_accumulation_steps(), lay.dims.dp_size
    if len(data.train) < micro * dp:
        raise StartupError(
            f"the training split has {len(data.train)} sequences of {args.seq_len} tokens, fewer than one micro-batch "
            f"({micro}) per data-parallel replica ({dp}): add data, lower --seq_len, or raise sequence_parallel_size"
        )
    state = {"epoch": 0, "sequences_in_epoch": 0, "tokens_seen": 0}
    step = 0
    if rank == 0 and args.resume == "auto" and resume_tag is None:
        print(f"ds_wallfacer.train: no complete checkpoint in {out / 'checkpoints'}: starting fresh", flush=True)
    if resume_tag is not None:
        saved = ckpt.load(engine, resume_tag, universal=universal)
        step = int(saved["step"])
        state = {k: saved[k] for k in state}
        if state["sequences_in_epoch"] % (micro * dp):
            raise StartupError(
                f"{resume_tag} stopped after {state['sequences_in_epoch']} sequences of its epoch, not a multiple of "
                f"this run's micro batch x data-parallel size = {micro * dp}: keep the global batch of the saved run"
            )
    export_dir = Path(args.export_dir) if args.export_dir else out / "hf_model"
    if args.export_only:
        export_hf(sp.model, loaded.tokenizer, export_dir, zero_stage=run_cfg.zero_stage)
        if rank == 0:
            print(json.dumps({"export_dir": str(export_dir), "step": step, "checkpoint": str(resume_tag)}), flush=True)
        engine.destroy()
        return 0

    watchdog = start_watchdog(timeout_s=args.watchdog_timeout)  # a dead or stalled rank ends the job, named
    wandb_run = None
    if rank == 0 and not args.no_wandb:
        wandb_run = init_wandb(
            output_dir=out, section=wandb_section, project=args.wandb_project, name=args.wandb_run_name,
            config={**vars(args), "model_source": loaded.source, "params": n_params, "dtype": str(dtype),
                    "world_size": world, "layout": lay.describe(), "resumed_from": str(resume_tag),
                    "train_sequences": len(data.train), "eval_sequences": len(data.eval), **lay.log_dict()},
        )
    predicted = (lay.planner_choice or {}).get("step_s")
    seq_per_step = micro * dp * gas
    flops = model_flops_per_step(
        params=n_params, layers=int(text_cfg.num_hidden_layers), q_heads=int(text_cfg.num_attention_heads),
        head_dim=int(getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads),
        seq_len=args.seq_len, sequences=seq_per_step,
    )
    peak = peak_tflops(dtype)

    def to_dev(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(engine.device) for k, v in batch.items()}

    eos = loaded.eos_id if args.document_masking else None  # documents end at EOS (train/data.py)

    def epoch_iter(epoch: int, start: int) -> Iterator[dict[str, torch.Tensor]]:
        src = train_batches(data.train, micro=micro, dp=dp, epoch=epoch, seed=args.seed, start=start, eos_id=eos)
        return iter(sp.dataloader(src, batch_size=micro))

    def evaluate() -> float:
        batches, counts = eval_batches(data.eval, micro=micro, dp=dp, eos_id=eos)
        mine = counts[lay.dims.dp_index(rank)::dp]
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        engine.eval()
        with torch.no_grad():
            for batch, count in zip(sp.dataloader(batches, batch_size=micro), mine):
                total[0] += engine(**to_dev(batch)).double() * count
                total[1] += count
        engine.train()
        s = _replica_mean(total, layout=lay, comm=sp.comm)
        return float(s[0] / s[1])

    log_file = out / "metrics.jsonl"
    bar = None
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=args.steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                       disable=None)  # None: no bar when stderr is not a terminal

    def record(values: dict[str, Any]) -> None:
        if rank != 0:
            return
        with open(log_file, "a") as f:
            f.write(json.dumps(values) + "\n")
        if wandb_run is not None:
            wandb_run.log({k: v for k, v in values.items() if k != "step"}, step=values["step"])

    losses: list[float] = []
    step_times: list[float] = []
    eval_loss: float | None = None
    last_ckpt: Path | None = resume_tag
    it = epoch_iter(state["epoch"], state["sequences_in_epoch"])
    if resume_tag is not None:
        ckpt.set_rng_state(ckpt.rng_for_rank(saved))  # last: nothing after the load may draw from an RNG first
    t_start = time.perf_counter()
    while step < args.steps:
        lr = float(engine.get_lr()[0])
        sp.comm.reset()
        t0 = time.perf_counter()
        acc = torch.zeros(2, device=engine.device)  # loss, MoE router aux loss
        for _ in range(gas):
            batch = next(it, None)
            if batch is None:  # epoch done: reshuffle
                state["epoch"] += 1
                state["sequences_in_epoch"] = 0
                it = epoch_iter(state["epoch"], 0)
                batch = next(it)
            loss = engine(**to_dev(batch))
            engine.backward(loss)
            engine.step()  # DeepSpeed updates at the accumulation boundary
            acc[0] += loss.detach().float()
            if sp.aux_loss is not None:
                acc[1] += sp.aux_loss.float()
            state["sequences_in_epoch"] += micro * dp
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        step += 1
        state["tokens_seen"] += seq_per_step * args.seq_len
        means = _replica_mean(acc / gas, layout=lay, comm=sp.comm)
        loss_v = float(means[0])
        losses.append(loss_v)
        step_times.append(dt)
        gn = engine.get_global_grad_norm()
        values: dict[str, Any] = {
            "step": step, "loss": loss_v, "lr": lr, "step_time_s": dt, "tokens_per_s": seq_per_step * args.seq_len / dt,
            "model_tflops": flops / dt / 1e12, "peak_memory_bytes": peak_memory_bytes(), "epoch": state["epoch"],
            **comm_bytes(sp.comm.sent),
        }
        if gn is not None:
            values["grad_norm"] = float(gn)
        if sp.aux_loss is not None:  # included in the loss, times router_aux_loss_coef
            values["aux_loss"] = float(means[1])
        if peak is not None:
            values["mfu"] = values["model_tflops"] / (peak * world)
        if data.eval.size and (step == args.steps or (args.eval_every and step % args.eval_every == 0)):
            eval_loss = values["eval_loss"] = evaluate()
        record(values)
        if rank == 0:
            line = f"step {step} loss {loss_v:.4f} lr {lr:.2e} {values['tokens_per_s']:.0f} tok/s {dt:.2f}s"
            if "eval_loss" in values:
                line += f" eval_loss {eval_loss:.4f}"
            if bar is not None:
                bar.set_postfix(loss=f"{loss_v:.4f}", tok_s=f"{values['tokens_per_s']:.0f}",
                                mem=f"{values['peak_memory_bytes'] / 2**30:.2f}GiB")
                bar.update(1)
                bar.write(line, file=sys.stdout)
            else:
                print(line, flush=True)
        due = bool(args.save_every) and step % args.save_every == 0 or (step == args.steps and not args.no_save)
        if due and (last_ckpt is None or last_ckpt.name != f"step_{step}"):
            position = {"micro_batches_in_epoch": state["sequences_in_epoch"] // (micro * dp),
                        "global_batch": seq_per_step}
            last_ckpt = ckpt.save(engine, out / "checkpoints", step=step, state={**state, **position})
    wall = time.perf_counter() - t_start
    if bar is not None:
        bar.close()
    exported = None
    if not args.no_export:
        exported = export_hf(sp.model, loaded.tokenizer, export_dir, zero_stage=run_cfg.zero_stage)
    if rank == 0:
        measured = statistics.median(step_times) if step_times else None
        summary = {
            "steps": step, "steps_this_run": len(losses), "first_loss": losses[0] if losses else None,
            "final_loss": losses[-1] if losses else None, "eval_loss": eval_loss,
            "finite": all(math.isfinite(x) for x in losses),
            "tokens_per_s": seq_per_step * args.seq_len / measured if measured else None, "wall_s": wall,
            "measured_step_s": measured, "predicted_step_s": predicted, "mode": lay.dims.mode,
            "sequence_parallel_size": lay.dims.sp_size, "data_parallel_size": lay.dims.dp_size,
            "ulysses_degree": lay.dims.ulysses_degree, "ring_count": lay.dims.ring_count, "placement": lay.dims.placement,
            "world_size": world, "seq_len": args.seq_len, "params": n_params, "dtype": str(dtype).replace("torch.", ""),
            "global_batch": seq_per_step, "train_sequences": len(data.train), "eval_sequences": len(data.eval),
            "mini_sequence": sp.mini_sequence is not None, "resumed_from": str(resume_tag) if resume_tag else None,
            "checkpoint": str(last_ckpt) if last_ckpt else None, "export_dir": str(exported) if exported else None,
            "metrics": str(log_file), "wandb_dir": None,
        }
        if wandb_run is not None:
            wandb_run.summary.update({"measured_step_s": measured, "predicted_step_s": predicted})
            summary["wandb_dir"] = str(Path(wandb_run.dir).parent)
            wandb_run.finish()
        print(json.dumps(summary), flush=True)
    if watchdog is not None:
        watchdog.stop()
    engine.destroy()
    return 0
