"""The trainer as steps: ``Trainer.build`` (every start-up refusal), ``resume``, ``train`` (``train_step``,
``evaluate``, ``save``), ``finish`` (export, summary), or ``stop`` after a preemption's save. Why in that order:
Note [Trainer start-up order] in docs/design/training.md.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ..hf_config import text_config
from ..integration.ds_runtime import close_distributed
from . import checkpoint as ckpt
from . import manifest
from .cli import StartupError, offline_defaults, settle_options
from .data import eval_batches, load_data
from .dynamic import DynamicData
from .export import export_hf
from .metrics import (comm_bytes, gather_rows, init_wandb, log_step, model_flops_per_step, peak_memory_bytes,
                      peak_tflops, replica_mean, run_summary, split_wandb_section)
from .model import dtype_of, load_model
from .nonfinite import NonFiniteRun, UpdateGate, check_step
from .order import DataOrder
from .schedule import scheduler_of
from .preempt import PREEMPTED_EXIT_CODE, Preemption, stop_reason
from .signals import SIGNAL_EXIT, SignalRelay
from .watchdog import launchers, say_as_rank, start_watchdog

__all__ = ["Trainer"]

Batch = dict[str, torch.Tensor]


class Trainer:
    """One rank's run. The loss it prints and logs per step is the global token-mean loss of its micro-batches,
    averaged over the gradient-accumulation micro-steps and the data-parallel replicas (every sequence is full, so
    this is the token mean over the whole global batch)."""

    # set by build(): the config, model, data and engine, and the sizes that follow from them
    option_notes: tuple[str, ...]
    """Where each option the ds_config can also set took its value from (``options.resolve_options``)."""
    wandb_section: dict[str, Any]
    run_cfg: Any
    resume_candidates: list[Path]
    resume_tag: Path | None
    universal: bool
    dtype: torch.dtype
    loaded: Any
    data: Any
    text_cfg: Any
    n_params: int
    engine: Any
    sp: Any
    setup: Any
    rank: int
    world: int
    micro: int
    dp: int
    gas: int
    seq_per_step: int
    eos: int | None
    order: DataOrder
    dynamic: DynamicData | None
    """The rows and steps under dynamic sequence parallelism, else None."""
    # set by start()
    flops: float
    peak: float | None
    preemption: Preemption | None
    gate: UpdateGate | None

    def __init__(self, args: Any) -> None:
        self.args = args
        self.out = Path(args.output_dir)
        self.export_dir = Path(args.export_dir) if args.export_dir else self.out / "hf_model"
        self.log_file = self.out / "metrics.jsonl"
        self.step = 0
        self.state = {"epoch": 0, "sequences_in_epoch": 0, "tokens_seen": 0}
        """Data position and token count, saved in every checkpoint."""
        self.losses: list[float] = []
        self.step_times: list[float] = []
        self.step_tokens: list[int] = []
        self.eval_loss: float | None = None
        self.saved: dict[str, Any] | None = None
        """The trainer state of the checkpoint resumed from."""
        self.last_ckpt: Path | None = None
        self.pending_save: ckpt.PendingSave | None = None
        """An asynchronous save (``--async_save``) not yet marked complete."""
        self.watchdog: Any = None
        self.launched_by = launchers()
        """Who launched this rank, read before the long start-up: a runner gone meanwhile is still seen."""
        self.wandb_run: Any = None
        self.bar: Any = None
        self.batches: Iterator[Batch] = iter(())
        self.wall_s = 0.0
        self.relay: SignalRelay | None = None
        self.stopped: str | None = None
        """Why the job stopped early to save (a preemption), once every rank has seen the request."""
        self.check: Any = None
        """The last step's ``nonfinite.StepCheck``."""
        self.nonfinite = NonFiniteRun(limit=args.nonfinite_limit)

    # -- start-up: every refusal, on every rank, before any training -----------------------------------------
    def build(self) -> None:
        """ds_config, checkpoint to resume, model, data, then the DeepSpeed engine and the sizes it decides."""
        args = self.args
        offline_defaults()
        raw, self.option_notes = settle_options(args)  # before the heavy imports: a contradiction is refused at once
        import ds_wallfacer.integration as wfi  # registers attn_implementation="wallfacer"

        from ..config import parse_ds_config

        ds_config, self.wandb_section = split_wandb_section(raw)
        try:
            self.run_cfg = parse_ds_config(ds_config)
        except ValueError as e:  # a bad "wallfacer" section or batch size: one line on every rank
            raise StartupError(f"--deepspeed_config {args.deepspeed_config!r}: {e}") from None
        if self.run_cfg.wallfacer.balance_steps and not args.document_masking:  # the flag: refused by cli.py
            raise StartupError(f"--deepspeed_config {args.deepspeed_config!r}: wallfacer.balance_steps = true evens "
                               "the documents' attention work, but without --document_masking every row is one causal "
                               "stream of equal work: add --document_masking or drop the key")
        if self.run_cfg.wallfacer.dynamic_sequence_parallel is not None and args.balance_steps:
            raise StartupError("--balance_steps with wallfacer.dynamic_sequence_parallel: the dynamic schedule lays "
                               "each step's rows out by their work itself; drop --balance_steps")
        self.resume_candidates = ckpt.resume_candidates(args.resume, self.out)  # verified in resume()
        self.resume_tag = self.resume_candidates[0] if self.resume_candidates else None
        self.dtype = dtype_of(self.run_cfg.deepspeed)
        self.loaded = loaded = load_model(args.model, seq_len=args.seq_len, dtype=self.dtype, seed=args.seed)
        self.data = load_data(args, loaded, dynamic=self.run_cfg.wallfacer.dynamic_sequence_parallel is not None)
        self.text_cfg = text_config(loaded.model)
        self.n_params = sum(p.numel() for p in loaded.model.parameters())  # before ZeRO-3 partitions them
        self._initialize(wfi, ds_config)
        self.setup = self.sp.setup
        dims = self.setup.dims
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.rank == 0:  # beside the layout line: where each value given twice (option, ds_config) came from
            print(f"ds_wallfacer.train: options: {'; '.join(self.option_notes)}", flush=True)
        self.micro, self.dp = self.run_cfg.micro_batch(dp_size=dims.dp_size), dims.dp_size
        self.gas = self.engine.gradient_accumulation_steps()
        self.seq_per_step = self.micro * self.dp * self.gas
        self.eos = loaded.eos_id if args.document_masking else None  # documents end at EOS (train/data.py)
        self.order = DataOrder(self.data.train, micro=self.micro, dp=self.dp, seed=args.seed, eos_id=self.eos,
                               balance=args.balance_steps or self.run_cfg.wallfacer.balance_steps)
        self.dynamic = None
        if self.sp.dynamic is not None:  # every document a row of its own length (train/dynamic.py)
            self.dynamic = DynamicData(self.sp, self.data.train, eos_id=loaded.eos_id, seq_len=args.seq_len,
                                       seed=args.seed, rows_per_step=self.seq_per_step)
        if len(self.data.train) < self.micro * self.dp:
            raise StartupError(
                f"the training split has {len(self.data.train)} sequences of {args.seq_len} tokens, fewer than one "
                f"micro-batch ({self.micro}) per data-parallel replica ({self.dp}): add data, lower --seq_len, or "
                "raise sequence_parallel_size"
            )

    def _initialize(self, wfi: Any, ds_config: dict[str, Any]) -> None:
        """``wfi.initialize`` with the optimizer and schedule the ds_config leaves to the options; a checkpoint
        written by another number of ranks is loaded through DeepSpeed's universal checkpoint."""
        args, model = self.args, self.loaded.model
        optimizer = None
        if not self.run_cfg.has_optimizer:
            optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
        scheduler = None if "scheduler" in ds_config else scheduler_of(args)  # else DeepSpeed builds the configured one
        world_now = int(os.environ.get("WORLD_SIZE", "1"))
        self.universal = self.resume_tag is not None and ckpt.saved_world_size(self.resume_tag) != world_now
        if self.universal:  # DeepSpeed's universal checkpoint re-partitions ZeRO state
            ds_config = {**ds_config, "checkpoint": {**(ds_config.get("checkpoint") or {}), "load_universal": True}}
        try:
            self.engine, self.sp = wfi.initialize(model=model, config=ds_config, optimizer=optimizer,
                                                  lr_scheduler=scheduler, seq_len=args.seq_len)
        except ValueError as e:  # sizes the model does not fit, or a model refused by the audit or the self-check
            if dist.is_initialized():
                dist.destroy_process_group()
            raise StartupError(str(e)) from None

    def resume(self) -> None:
        """Load the first checkpoint of those ``build`` listed that every rank verifies (its RNG states only in
        ``start``, last). Note [Verified checkpoints]: with ``auto`` each tag skipped gets a line; a path that
        fails is refused."""
        tag, skipped = None, []
        if self.args.resume is not None:  # on every rank, even one whose disk lists no tag: rank 0's list counts
            tag, skipped = ckpt.choose_resume(self.resume_candidates, universal=self.universal, group=dist.group.WORLD)
        if tag is None and skipped and self.args.resume != "auto":
            raise StartupError(f"--resume {self.args.resume!r} fails verification: {skipped[0]}")
        self.resume_tag = self.last_ckpt = tag
        if self.rank == 0:
            for line in skipped:
                print(f"ds_wallfacer.train: skipped checkpoint {line}", flush=True)
            if self.args.resume == "auto" and tag is None:
                print(f"ds_wallfacer.train: no complete checkpoint in {self.out / 'checkpoints'}"
                      f"{' that verifies' if skipped else ''}: starting fresh", flush=True)
            if tag is not None and not ckpt.verifiable(tag):
                print(f"ds_wallfacer.train: note: {tag} lists no files (written by an earlier version): resumed "
                      "without verifying them", flush=True)
        if tag is None:
            return
        self.saved = ckpt.load(self.engine, tag, universal=self.universal)
        self.step = int(self.saved["step"])
        self.state = {k: self.saved[k] for k in self.state}
        error = self.order.resume_error(int(self.saved.get("balanced_round", 0)), self.state["sequences_in_epoch"])
        if error is not None:
            raise StartupError(f"{tag}: {error}")
        if self.state["sequences_in_epoch"] % (self.micro * self.dp):
            raise StartupError(
                f"{tag} stopped after {self.state['sequences_in_epoch']} sequences of its epoch, not a multiple of "
                f"this run's micro batch x data-parallel size = {self.micro * self.dp}: keep the global batch of the "
                "saved run"
            )

    def export_only(self) -> int:
        """``--export_only``: the loaded (or initial) model as an HF checkpoint, then done."""
        export_hf(self.sp.model, self._saved_tokenizer(), self.export_dir, zero_stage=self.run_cfg.zero_stage)
        if self.rank == 0:
            print(json.dumps({"export_dir": str(self.export_dir), "step": self.step,
                              "checkpoint": str(self.resume_tag)}), flush=True)
        self.engine.destroy()
        return 0

    def start(self) -> None:
        """Watchdog, wandb, progress bar, the data position; the saved RNG states last of all."""
        args, setup, data = self.args, self.setup, self.data
        self.preemption = None
        if args.on_preempt == "save":
            self.preemption = Preemption(grace_s=args.preempt_grace_s, end=self._end_rank, say=self._say)
        # a dead or stalled rank ends the job, named; signals go to the preemption unless a peer is gone
        self.watchdog = start_watchdog(timeout_s=args.watchdog_timeout, preemption=self.preemption,
                                       launched_by=self.launched_by)
        if self.watchdog is None and self.preemption is not None:  # one rank, or no watchdog: signals all the same
            self.relay = SignalRelay(self._on_signal)
            self.relay.install()
        opt = UpdateGate.needed(self.engine)
        self.gate = None if opt is None else UpdateGate(opt, comm=self.sp.comm, device=self.engine.device)
        if self.rank == 0 and not args.no_wandb:
            self.wandb_run = init_wandb(
                output_dir=self.out, section=self.wandb_section, project=args.wandb_project, name=args.wandb_run_name,
                config={**vars(args), "model_source": self.loaded.source, "params": self.n_params,
                        "dtype": str(self.dtype), "world_size": self.world, "layout": setup.describe(),
                        "resumed_from": str(self.resume_tag), "train_sequences": len(data.train),
                        "option_sources": list(self.option_notes),
                        "eval_sequences": len(data.eval), **setup.log_dict()},
            )
        cfg = self.text_cfg
        self.flops = model_flops_per_step(
            params=self.n_params, layers=int(cfg.num_hidden_layers), q_heads=int(cfg.num_attention_heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads),
            seq_len=args.seq_len, sequences=self.seq_per_step,
        )
        self.peak = peak_tflops(self.dtype)
        if self.rank == 0:
            self.out.mkdir(parents=True, exist_ok=True)
            if not args.no_progress:
                from tqdm import tqdm

                self.bar = tqdm(total=args.steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                                disable=None)  # None: no bar when stderr is not a terminal
        if self.dynamic is not None:
            self.dynamic.start(self.state)
        else:
            self.batches = self._epoch(self.state["epoch"], self.state["sequences_in_epoch"])
        if self.saved is not None:
            ckpt.set_rng_state(ckpt.rng_for_rank(self.saved))  # last: nothing after the load may draw from an RNG first

    # -- training -------------------------------------------------------------------------------------------
    def train(self) -> None:
        """Steps until ``--steps`` or a stop request, evaluating, logging and checkpointing as the options say;
        ``NonFiniteStop`` after ``--nonfinite_limit`` non-finite steps in a row."""
        args = self.args
        t_start = time.perf_counter()
        while self.step < args.steps:
            values = self.train_step()
            final = self.step == args.steps
            due_eval = final or (args.eval_every and self.step % args.eval_every == 0)
            if self.data.eval.size and due_eval and not self.stopped:
                self.eval_loss = values["eval_loss"] = self.evaluate()
            self.log(values)
            self.nonfinite.observe(self.check, step=self.step, epoch=self.state["epoch"],
                                   seq_end=self.state["sequences_in_epoch"], seq_per_step=self.seq_per_step,
                                   last_ckpt=self.last_ckpt)
            due = bool(args.save_every) and self.step % args.save_every == 0 or (final and not args.no_save)
            if (due or self.stopped) and (self.last_ckpt is None or self.last_ckpt.name != f"step_{self.step}"):
                self.save()
            self.settle_save(wait=False)
            if self.stopped:
                break
        self.settle_save(wait=True)  # before the export and the summary
        if self.preemption is not None and self.last_ckpt is not None and self.last_ckpt.name == f"step_{self.step}":
            self.preemption.saved()  # the work is safe: a signal from now on ends the rank at once
        self.wall_s = time.perf_counter() - t_start

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (``gas`` micro-batches); its metrics."""
        engine, sp, seq_len = self.engine, self.sp, self.args.seq_len
        lr = float(engine.get_lr()[0])
        sp.comm.reset()
        t0 = time.perf_counter()
        acc = torch.zeros(3, device=engine.device)  # loss, MoE router aux loss, stop request
        imbalance: list[float | None] = [None]  # of each round: busiest replica's attention work / the mean's
        if self.dynamic is not None:
            tokens = self.dynamic.train_step(engine, state=self.state, acc=acc, gate=self.gate,
                                             to_device=self._to_device)
        else:
            tokens = self.seq_per_step * seq_len
            imbalance = []
            for i in range(self.gas):
                batch = self._next_batch()
                imbalance.append(self.order.imbalance(self.state["sequences_in_epoch"]))
                loss = engine(**self._to_device(batch))
                engine.backward(loss)
                acc[0] += loss.detach().float()
                if sp.aux_loss is not None:
                    acc[1] += sp.aux_loss.float()
                if self.gate is not None and i == self.gas - 1:
                    self.gate.loss_finite = bool(torch.isfinite(acc[0]))
                engine.step()  # DeepSpeed updates at the accumulation boundary
                self.state["sequences_in_epoch"] += self.micro * self.dp
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.step += 1
        self.state["tokens_seen"] += tokens
        if self.preemption is not None:
            acc[2] = self.preemption.flag()
        rows = gather_rows(acc, comm=sp.comm)  # one collective: the losses and any rank's stop request
        if self.dynamic is not None:  # every rank's forwards return its share of the step's loss x W x GA
            means = rows[:, :2].sum(0) / (self.world * self.gas)
        else:
            means = replica_mean(rows[:, :2] / self.gas, dims=self.setup.dims)
        if bool(rows[:, 2].any()):
            self.stopped = stop_reason(rows[:, 2].tolist())
        loss_v = float(means[0])
        self.losses.append(loss_v)
        self.step_times.append(dt)
        self.step_tokens.append(tokens)
        gn = engine.get_global_grad_norm()
        self.check = check_step((rows[:, 0] / self.gas).tolist(), None if gn is None else float(gn),
                                applied=engine.was_step_applied(), fp16=self.dtype == torch.float16)
        values: dict[str, Any] = {
            "step": self.step, "loss": loss_v, "lr": lr, "step_time_s": dt,
            "tokens_per_s": tokens / dt, "model_tflops": self.flops / dt / 1e12,
            "peak_memory_bytes": peak_memory_bytes(), "epoch": self.state["epoch"], **comm_bytes(sp.comm.sent),
        }
        if gn is not None:
            values["grad_norm"] = float(gn)
        if imbalance[0] is not None:  # the step's worst round
            values["attention_work_imbalance"] = max(imbalance)
        if not self.check.finite:
            values["skipped"] = self.check.describe()
        if sp.aux_loss is not None:  # included in the loss, times router_aux_loss_coef
            values["aux_loss"] = float(means[1])
        if self.peak is not None:
            values["mfu"] = values["model_tflops"] / (self.peak * self.world)
        return values

    def evaluate(self) -> float:
        """Token-mean loss over the held-out sequences (every rank takes part)."""
        engine = self.engine
        batches, counts = eval_batches(self.data.eval, micro=self.micro, dp=self.dp, eos_id=self.eos)
        mine = counts[self.setup.dims.dp_index(self.rank)::self.dp]
        total = torch.zeros(2, dtype=torch.float64, device=engine.device)
        engine.eval()
        with torch.no_grad():
            for batch, count in zip(self.sp.dataloader(batches, batch_size=self.micro, dynamic=False), mine):
                total[0] += engine(**self._to_device(batch)).double() * count
                total[1] += count
        engine.train()
        s = replica_mean(gather_rows(total, comm=self.sp.comm), dims=self.setup.dims)
        return float(s[0] / s[1])

    def save(self) -> None:
        """A checkpoint of this step, with the data position, if every rank has room for it (else ``SaveRefused``
        before anything is written); then only the newest ``--save_total_limit`` tags are kept. ``--async_save``:
        back as soon as the state is copied to host memory; ``settle_save`` marks the tag, then prunes."""
        self.settle_save(wait=True)  # one save at a time
        position = {"micro_batches_in_epoch": self.state["sequences_in_epoch"] // (self.micro * self.dp),
                    "global_batch": self.seq_per_step, "balanced_round": self.order.round_rows}
        estimate = manifest.estimate_bytes(self.last_ckpt, params=self.n_params, param_bytes=self.dtype.itemsize)
        try:
            saved = ckpt.save(self.engine, self.out / "checkpoints", step=self.step, state={**self.state, **position},
                              estimate=estimate, group=dist.group.WORLD, asynchronous=self.args.async_save)
        except ckpt.SaveRefused:
            if self.watchdog is not None:  # every rank leaves with the same line: no peer is at fault
                self.watchdog.stop()
            raise
        if isinstance(saved, ckpt.PendingSave):
            self.pending_save = saved
            return
        self.last_ckpt = saved
        self._prune()

    def settle_save(self, *, wait: bool) -> None:
        """Collective, at the same point on every rank: the pending asynchronous save, once every rank's writer is
        done (``wait``: block until then), marked complete, then old tags pruned; a writer that failed on any rank
        is ``SaveFailed`` on every rank. Note [Asynchronous saves]."""
        pending = self.pending_save
        if pending is None:
            return
        try:
            if not wait and not pending.poll(self.sp.comm, device=self.engine.device):
                return
            self.pending_save = None
            self.last_ckpt = pending.finalize()
        except ckpt.SaveFailed:
            if self.watchdog is not None:  # every rank leaves with the same line: no peer is at fault
                self.watchdog.stop()
            raise
        self._prune()

    def _prune(self) -> None:
        if self.args.save_total_limit:  # the tag just written is the newest verified one: never deleted
            ckpt.prune(self.out / "checkpoints", keep=self.args.save_total_limit, protect=[self.last_ckpt],
                       group=dist.group.WORLD)

    def log(self, values: dict[str, Any]) -> None:
        """Rank 0: a line of ``metrics.jsonl``, wandb, and the step's line (through the progress bar if any)."""
        if self.rank == 0:
            log_step(values, log_file=self.log_file, wandb_run=self.wandb_run, bar=self.bar)

    def _epoch(self, epoch: int, start: int) -> Iterator[Batch]:
        src = self.order.epoch(epoch, start)
        return iter(self.sp.dataloader(src, batch_size=self.micro, balance_steps=False, dynamic=False))  # ordered

    def _next_batch(self) -> Batch:
        batch = next(self.batches, None)
        if batch is None:  # epoch done: reshuffle
            self.state["epoch"] += 1
            self.state["sequences_in_epoch"] = 0
            self.batches = self._epoch(self.state["epoch"], 0)
            batch = next(self.batches)
        return batch

    def _to_device(self, batch: Batch) -> Batch:
        return {k: v.to(self.engine.device) for k, v in batch.items()}

    def _saved_tokenizer(self) -> Any:
        """What the export saves beside the model: the processor of conversations with images, else the tokenizer."""
        return getattr(self.data, "processor", None) or self.loaded.tokenizer

    # -- signals (Note [Save on preemption]) ---------------------------------------------------------------
    def _say(self, line: str) -> None:
        if self.watchdog is not None:
            self.watchdog.say(line)
        else:
            say_as_rank(line)

    def _end_rank(self, what: str, code: int) -> None:
        if self.watchdog is not None:
            self.watchdog.end(what, code)  # returns only if another thread is already ending the rank
            return
        say_as_rank(f"{what}; ending this rank (exit code {code})")
        os._exit(code)

    def _on_signal(self, signum: int) -> None:
        """A signal with no watchdog (one rank): SIGINT ends the rank, others go to the preemption."""
        sig = signal.Signals(signum)
        if sig == signal.SIGINT or self.preemption is None:
            self._end_rank("interrupted (SIGINT)" if sig == signal.SIGINT else f"stopped by {sig.name}",
                           SIGNAL_EXIT[sig])
        else:
            self.preemption.request_signal(signum)

    # -- the end --------------------------------------------------------------------------------------------
    def finish(self, *, export: bool = True) -> None:
        """Export, the summary line (rank 0), and the watchdog and engine stopped."""
        if self.bar is not None:
            self.bar.close()
        exported = None
        if export and not self.args.no_export:
            exported = export_hf(self.sp.model, self._saved_tokenizer(), self.export_dir,
                                 zero_stage=self.run_cfg.zero_stage)
        if self.rank == 0:
            print(json.dumps(self.summary(exported)), flush=True)
        self.close()

    def stop(self) -> int:
        """After a stop request's checkpoint: one line (rank 0), the summary, no export; ``PREEMPTED_EXIT_CODE``."""
        if self.rank == 0:
            print(f"ds_wallfacer.train: stopped after step {self.step} ({self.stopped}): saved {self.last_ckpt}; "
                  f"continue with --resume auto (exit status {PREEMPTED_EXIT_CODE})", file=sys.stderr, flush=True)
        self.finish(export=False)
        return PREEMPTED_EXIT_CODE

    def close(self) -> None:
        """The watchdog, signal handlers and engine stopped (also after ``NonFiniteStop``), then the process groups
        destroyed and our threads joined (Note [A clean exit], docs/trainer.md)."""
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.relay is not None:
            self.relay.restore()
        self.engine.destroy()
        close_distributed()

    def summary(self, exported: Path | None) -> dict[str, Any]:
        """The run's last line (rank 0), as JSON; closes the wandb run (``metrics.run_summary``)."""
        return run_summary(self, exported)
