"""Command-line options of the trainer (``python -m ds_wallfacer.train`` / ``launch/train.py``).

Every option has a default, so ``deepspeed --num_gpus 4 --module ds_wallfacer.train`` trains the tiny built-in
Llama on the demo corpus with the example config ``wallfacer`` (both shipped in ``ds_wallfacer.examples``), from
any folder. The options the ds_config can also set (``options.DEFAULTS``) are None here unless given:
``options.resolve_options`` decides their one value against the ds_config at start-up. Errors found in the options
themselves (paths, sizes) are ``StartupError``: the trainer prints one line and exits with status 2 on every rank,
before any process group exists.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from .. import examples
from .options import DEFAULTS, given_options, resolve_options

__all__ = ["DEFAULT_CONFIG", "DEFAULT_DATA", "StartupError", "offline_defaults", "parse_args", "read_ds_config",
           "settle_options"]

DEFAULT_DATA = examples.DATA_DIR
"""The demo corpus (a few KB of text)."""
DEFAULT_CONFIG = examples.CONFIG_DIR / "wallfacer.json"


class StartupError(ValueError):
    """A refusal at start-up: the message says what is wrong and what to change."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m ds_wallfacer.train",
        description="Train an HF causal LM with sequence parallelism through DeepSpeed (launch with `deepspeed`).",
    )
    p.add_argument("--deepspeed_config", default=str(DEFAULT_CONFIG),
                   help='ds_config JSON with a "wallfacer" section, or the name of a shipped example: '
                        + ", ".join(examples.config_names()))
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (LOCAL_RANK is used)")
    _model_and_data(p.add_argument_group("model and data"))
    _optimisation(p.add_argument_group("optimisation", description=(
        'an option the ds_config also sets fills a key it leaves open (absent or "auto"), agrees with a key it sets '
        'to the same value, and is refused where they differ (docs/trainer.md, "Values given twice")')))
    _checkpoints(p.add_argument_group("checkpoints and export"))
    _logging(p.add_argument_group("logging"))
    args = p.parse_args(argv)
    _check(args)
    return args


def _model_and_data(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", default="tiny-llama",
                   help="an HF model directory (weights -> from_pretrained, config only -> random init), a "
                        "config.json, or a preset name (ds_wallfacer.train.model.PRESETS)")
    g.add_argument("--data", default=str(DEFAULT_DATA),
                   help="a .txt / .jsonl / .parquet file, a folder of them, or a datasets.save_to_disk folder")
    g.add_argument("--text_field", default="text", help="the text column of .jsonl / .parquet / saved datasets")
    g.add_argument("--seq_len", type=int, default=512, help="tokens per training sequence")
    g.add_argument("--document_masking", action="store_true",
                   help="each document (text up to and including EOS) attends only to itself, with positions "
                        "restarting at 0, as if trained alone (packed documents; default: one causal stream)")
    g.add_argument("--balance_steps", action="store_true",
                   help="with --document_masking: put rows of even attention work (their documents' squares) into "
                        "each round of micro-batches, so no data-parallel replica waits on another; rows are "
                        "not cut or repacked, only their order within the epoch changes")
    g.add_argument("--eval_fraction", type=float, default=0.05,
                   help="share of sequences held out for evaluation (0 = no evaluation)")
    g.add_argument("--eval_every", type=int, default=50, help="evaluate every N optimizer steps (and at the end)")
    g.add_argument("--cache_dir", default=None,
                   help="tokenised-data cache (default: OUTPUT_DIR/token_cache)")


def _optimisation(g: argparse._ArgumentGroup) -> None:
    # default None = "not given": the ds_config may set these too, and options.py decides the one value (given
    # and equal: fine; given and different: refused; not given: the ds_config's, else the default shown here)
    d = DEFAULTS
    g.add_argument("--steps", type=int, default=None,
                   help=f"optimizer steps in total; the schedule spans them (default: the ds_config scheduler's "
                        f"total_num_steps, else {d['steps']})")
    g.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default: the ds_config's optimizer.params.lr or scheduler "
                        f"warmup_max_lr, else {d['lr']:g})")
    g.add_argument("--warmup_steps", type=int, default=None,
                   help=f"linear warm-up steps (default: the ds_config scheduler's warmup_num_steps, else "
                        f"{d['warmup_steps']})")
    g.add_argument("--lr_decay", choices=("cosine", "linear", "constant"), default=None,
                   help=f"decay after warm-up, to --min_lr_ratio x peak at --steps (default: {d['lr_decay']}); with "
                        "a ds_config scheduler it must name the same decay (WarmupCosineLR, WarmupDecayLR, WarmupLR)")
    g.add_argument("--min_lr_ratio", type=float, default=None,
                   help=f"final learning rate / peak (default: the ds_config scheduler's, else "
                        f"{d['min_lr_ratio']})")
    g.add_argument("--seed", type=int, default=0, help="initial weights, data order and every RNG")
    g.add_argument("--nonfinite_limit", type=int, default=3,
                   help="a step whose loss or gradient norm is NaN/inf on any rank is skipped (no update) and logged; "
                        "this many in a row stop the job with exit status 4 (1: stop at the first; 0: never stop)")


def _checkpoints(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--output_dir", default="runs", help="checkpoints, wandb run, metrics.jsonl, export")
    g.add_argument("--save_every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    g.add_argument("--resume", default=None,
                   help='"auto" = the latest complete checkpoint in OUTPUT_DIR/checkpoints whose files match its '
                        "marker (older ones in turn; none: start fresh), or a checkpoint tag directory (refused if "
                        "its files do not match)")
    g.add_argument("--no_save", action="store_true", help="write no checkpoint at the end")
    g.add_argument("--save_total_limit", type=int, default=0,
                   help="after each save keep only the newest N complete checkpoints, never the one just written "
                        "(0: keep all)")
    g.add_argument("--async_save", action="store_true",
                   help="write checkpoint files in a background thread: a save holds training only while the state "
                        "is copied to host memory; the tag is marked complete (and older ones pruned) once every "
                        "rank's files are on disk (default: off, training waits for the write)")
    g.add_argument("--on_preempt", choices=("save", "exit"), default="save",
                   help="on SIGTERM or SIGUSR1 (or the launcher gone): save = every rank finishes its step, saves a "
                        "checkpoint and exits with status 75 (continue with --resume auto); exit = end at once")
    g.add_argument("--preempt_grace_s", type=float, default=120.0,
                   help="seconds from the stop request to a complete checkpoint, else the rank ends without it (0: no "
                        "limit); keep it under what the scheduler allows (SLURM's KillWait; deepspeed's launch.py "
                        "kills a rank 30 s after passing a SIGTERM on)")
    g.add_argument("--export_dir", default=None,
                   help="export the final model as an HF checkpoint here (default: OUTPUT_DIR/hf_model)")
    g.add_argument("--no_export", action="store_true", help="do not export the model at the end")
    g.add_argument("--export_only", action="store_true",
                   help="load --resume (or the initial model), export it to the export dir, do not train")


def _logging(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--wandb_project", default=None,
                   help='wandb project (default: the ds_config "wandb" section\'s, else "ds_wallfacer")')
    g.add_argument("--wandb_run_name", default=None)
    g.add_argument("--no_wandb", action="store_true", help="do not log to wandb")
    g.add_argument("--no_progress", action="store_true", help="no progress bar (per-step lines only)")
    g.add_argument("--watchdog_timeout", type=float, default=30.0,
                   help="seconds without a heartbeat after which a rank counts as stalled: every rank then ends "
                        "with one line naming it (ds_wallfacer.train.watchdog; 0: no watchdog)")


def _check(args: argparse.Namespace) -> None:
    """Option values that are wrong whatever the model and data."""
    for name in ("seq_len", "steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise StartupError(f"--{name} = {getattr(args, name)} must be at least 1")
    for name in ("eval_every", "save_every", "save_total_limit", "warmup_steps", "watchdog_timeout", "preempt_grace_s",
                 "nonfinite_limit"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise StartupError(f"--{name} = {getattr(args, name)} must be >= 0")
    if not 0.0 <= args.eval_fraction < 1.0:
        raise StartupError(f"--eval_fraction = {args.eval_fraction} must be in [0, 1)")
    if args.min_lr_ratio is not None and not 0.0 <= args.min_lr_ratio <= 1.0:
        raise StartupError(f"--min_lr_ratio = {args.min_lr_ratio} must be in [0, 1]")
    if args.balance_steps and not args.document_masking:
        raise StartupError("--balance_steps evens the documents' attention work, but without --document_masking "
                           "every row is one causal stream of equal work: add --document_masking or drop "
                           "--balance_steps")
    if not Path(args.data).exists():
        raise StartupError(f"--data {args.data!r} does not exist: give a .txt/.jsonl/.parquet file, a folder of "
                           "them, or a datasets.save_to_disk folder")
    if not Path(args.deepspeed_config).is_file():
        shipped = examples.find_config(args.deepspeed_config)
        if shipped is None:
            raise StartupError(f"--deepspeed_config {args.deepspeed_config!r} does not exist (nor is it a shipped "
                               f"example: {', '.join(examples.config_names())})")
        args.deepspeed_config = str(shipped)
    if args.resume not in (None, "auto") and not Path(args.resume).is_dir():
        raise StartupError(f"--resume {args.resume!r} is not a checkpoint directory: give \"auto\" or a tag "
                           "directory such as OUTPUT_DIR/checkpoints/step_100")


def offline_defaults() -> None:
    """Nothing reaches a network unless asked: wandb offline, datasets and the hub local; CPU ranks where there is
    no GPU, with ``OMP_NUM_THREADS`` threads."""
    import torch

    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never a hub
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def read_ds_config(path: str) -> dict[str, Any]:
    """``--deepspeed_config`` as a dict, or a ``StartupError`` naming what is wrong with the file."""
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise StartupError(f"--deepspeed_config {path!r} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise StartupError(f"--deepspeed_config {path!r} must hold a JSON object")
    return raw


def settle_options(args: argparse.Namespace) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The one value of each option the ds_config can also set (``options.resolve_options``), written back into
    ``args`` so every later reader (the loop, the schedule, wandb) sees it: (the ds_config with the options filled
    in, where each value came from). A contradiction is a ``StartupError`` naming both values."""
    try:
        resolved = resolve_options(given=given_options(args), ds_config=read_ds_config(args.deepspeed_config))
    except ValueError as e:
        raise StartupError(f"--deepspeed_config {args.deepspeed_config!r}: {e}") from None
    vars(args).update(resolved.values)
    return resolved.ds_config, resolved.notes
