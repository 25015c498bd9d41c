"""The sweep over transformers itself: every causal-LM class, tiny, on 4 CPU ranks, trains exactly or is refused.

For each class of ``tiny.causal_lm_classes()``: the parent builds it tiny (``tiny.build_tiny``) and trains it
``STEPS`` SGD steps on one random sequence with the model's own attention and loss (the non-parallel reference);
then 4 forked gloo ranks build the same model and call ``ds_wallfacer.integration.initialize`` (hybrid mode:
Ulysses 2 x ring 2, zigzag; WallFacer C = 2 when the heads do not split) and train the same steps through the
DeepSpeed engine (ZeRO-1, SGD, no clipping). Verdicts:

- ``exact``: every step's loss within 1e-5 (relative) and every parameter's update within 1e-3 (relative, with
  the self-check's floor of 1e-3 x the largest update) of the reference;
- ``refused``: every rank raised the same refusal from ``initialize``, before training;
- ``not buildable``: the class cannot be built tiny or run text-only on CPU (the reason says why);
- anything else fails the sweep: ``WRONG`` (trained, but differs), ``FAILED`` (an error after start-up, or a
  refusal that differs between ranks), ``HANG``.

    python -m tests.sweep.run [--only llama,gpt_oss] [--write docs/models.md]
    python -m tests.sweep.run --compare docs/models.md runs/latest/models.md   (verdicts that changed)

Ranks are forked (``run_distributed(start_method="fork")``) and share the parent's imports, so each class costs
its own work, not a Python start-up.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.dist_utils import run_distributed
from tests.sweep.tiny import NotBuildable, build_tiny, causal_lm_classes, forward_kwargs

WORLD = 4
SEQ = 64
STEPS = 2
LR = 0.05
LOSS_TOL, UPDATE_TOL = 1e-5, 1e-3
TIMEOUT_S = 180.0
PASSING = ("exact", "refused", "not buildable")


@dataclass
class Row:
    cls: str
    model_type: str
    verdict: str
    detail: str = ""
    mode: str = ""
    seconds: float = 0.0


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(1))


def _vocab(model: torch.nn.Module) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def _reference(model_type: str, cls: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(losses, initial params, final params) of plain SGD on one process with the model's own attention."""
    model = build_tiny(model_type, cls)
    ids = _batch(_vocab(model))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        out = model(**forward_kwargs(model, ids), use_cache=False)
        losses.append(out.loss.item())
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, start, {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(mode: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True, "wallfacer": {"sequence_parallel_size": WORLD, **mode}}


MODES = ({"mode": "hybrid", "ulysses_degree": 2, "ring_count": 1}, {"mode": "wallfacer", "ring_count": 2})


def _rank(rank: int, world: int, model_type: str, cls: str) -> tuple[str, Any, str]:
    """One rank's (status, payload, mode); an error after start-up is a result here, not an exception."""
    try:
        return _train(rank, model_type, cls)
    except Exception:  # noqa: BLE001 - every failure reaches the parent as a verdict
        return "FAILED", traceback.format_exc(limit=6), ""


def _train(rank: int, model_type: str, cls: str) -> tuple[str, Any, str]:
    import ds_wallfacer.integration as wfi
    from ds_wallfacer.audit.model_audit import RefusedModel

    model = build_tiny(model_type, cls)
    ids = _batch(_vocab(model))
    first: Exception | None = None
    for mode in MODES:
        try:
            engine, sp = wfi.initialize(model=model, config=_config(mode),
                                        optimizer=torch.optim.SGD(model.parameters(), lr=LR))
            break
        except RefusedModel as err:
            return "refused", str(err), mode["mode"]
        except ValueError as err:  # e.g. a layout this model's heads do not allow: the next mode
            first = first or err
            model = build_tiny(model_type, cls)
    else:  # refused at start-up in every mode, by a plain ValueError
        return "refused", str(first), MODES[0]["mode"]
    losses = []
    for _ in range(STEPS):
        loss = engine(**sp.shard({"input_ids": ids}))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    # numpy arrays travel by value (a tensor would travel as a shared-memory handle that dies with this process)
    params = {n: p.detach().numpy().copy() for n, p in sp.model.named_parameters()} if rank == 0 else None
    return "trained", (losses, params), mode["mode"]


def _compare(ref: tuple, losses: list[float], params: dict[str, torch.Tensor]) -> tuple[str, str]:
    ref_losses, start, final = ref
    loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    ref_upd = {n: (final[n] - start[n]).double() for n in final}
    floor = 1e-3 * max((float(u.norm()) for u in ref_upd.values()), default=0.0) or 1e-30
    errs = {n: float(((params[n] - start[n]).double() - ref_upd[n]).norm()) / max(float(ref_upd[n].norm()), floor)
            for n in final}
    name, worst = max(errs.items(), key=lambda kv: kv[1])
    detail = f"loss {loss_err:.1e}, update {worst:.1e} ({name})"
    return ("exact" if loss_err <= LOSS_TOL and worst <= UPDATE_TOL else "WRONG"), detail


def _first_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if lines and lines[0].startswith("Traceback"):
        return lines[-1][:limit]  # the exception itself
    if lines and "start-up self-check" in lines[0]:
        why = lines[0].split("self-check (one short sequence with and without sequence parallelism) ")[-1]
        return f"self-check: {why} {' / '.join(lines[1:3])}"[:limit]
    body = " / ".join(lines[1:4]) if len(lines) > 1 and lines[0].endswith(":") else (lines[-1] if lines else "")
    return body[:limit]


def sweep_one(model_type: str, cls: str) -> Row:
    t0 = time.perf_counter()
    row = Row(cls, model_type, "")
    try:
        ref = _reference(model_type, cls)
    except NotBuildable as err:
        row.verdict, row.detail = "not buildable", str(err)
        return row
    try:
        got = run_distributed(_rank, WORLD, model_type, cls, timeout_s=TIMEOUT_S, start_method="fork")
    except AssertionError as err:  # a rank hung, died without a word, or failed before the model was built
        row.seconds = time.perf_counter() - t0
        row.verdict = "HANG" if "did not finish" in str(err) else "FAILED"
        row.detail = str(err).splitlines()[0]
        return row
    row.seconds = time.perf_counter() - t0
    statuses = {s for s, _, _ in got}
    row.mode = next((m for _, _, m in got if m), "")
    if statuses == {"refused"}:
        msgs = {p for _, p, _ in got}
        row.verdict = "refused" if len(msgs) == 1 else "FAILED"
        row.detail = _first_line(msgs.pop()) if len(msgs) == 1 else "the ranks refused with different messages"
    elif statuses == {"trained"}:
        losses, params = got[0][1]
        row.verdict, row.detail = _compare(ref, losses, {n: torch.from_numpy(a) for n, a in params.items()})
    else:
        bad = next(p for s, p, _ in got if s == "FAILED") if "FAILED" in statuses else str(statuses)
        row.verdict, row.detail = "FAILED", _first_line(bad)
    return row


def recogniser_misses(model_type: str, cls: str) -> list[str]:
    """For a class that should be exact: each layer built like a mixer kind that no recogniser matched, with the
    parts of the closest known form its forward lacks (where a transformers release changed the layer)."""
    from ds_wallfacer.adapters.mixer_layers import near_misses

    try:
        model = build_tiny(model_type, cls)
    except NotBuildable as err:
        return [f"not buildable: {err}"]
    return [f"{name}: {kind}: missing {miss}" for name, kind, misses in near_misses(model) for miss in misses]


def write_table(rows: list[Row], path: Path) -> None:
    import transformers

    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    lines = [
        "# Supported models",
        "",
        f"Every causal-LM class of transformers {transformers.__version__} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built",
        "tiny from its config class and trained 2 SGD steps on 4 CPU ranks (Ulysses 2 x ring 2, or WallFacer C = 2",
        "where the heads do not split) against the same model on one process. **exact**: loss within 1e-5 and every",
        "update within 1e-3 of the reference; **refused**: `initialize` refuses it at start-up on every rank, with the",
        "reason shown (the deny-by-default rules or the start-up self-check, docs/design/audit.md); **not buildable**: it",
        "cannot be built tiny or run text-only on CPU. Nothing else passes. Produced by",
        "`WALLFACER_SWEEP_TABLE=docs/models.md bash launch/sweep.sh` on "
        f"{datetime.date.today().isoformat()}: " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".",
        "",
        *table_rows(rows),
    ]
    path.write_text("\n".join(lines) + "\n")


def table_rows(rows: list[Row]) -> list[str]:
    """The markdown table of ``rows``: the header, then the failures, exact, refused and not buildable."""
    lines = ["| class | model_type | verdict | mode | detail |", "| --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (PASSING.index(r.verdict) if r.verdict in PASSING else -1, r.cls)):
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.cls} | {r.model_type} | {r.verdict} | {r.mode} | {detail} |")
    return lines


def read_table(path: Path) -> tuple[str, dict[str, tuple[str, str]]]:
    """(the transformers version it names, {class: (verdict, detail)}) of a table ``write_table`` wrote; the rows
    of its multimodal section (``multimodal.table_lines``) as "<class> (images)"."""
    text = Path(path).read_text()
    named = re.search(r"transformers (\S+)", text)
    rows, suffix = {}, ""
    for line in text.splitlines():
        if line.startswith("## With images"):
            suffix = " (images)"
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| ") and len(cells) == 5 and cells[2] in (*PASSING, "WRONG", "FAILED", "HANG"):
            rows[cells[0] + suffix] = (cells[2], cells[4])
    return (named.group(1) if named else "?"), rows


def compare_tables(old: Path, new: Path) -> list[str]:
    """Lines saying which classes changed verdict from table ``old`` to table ``new``, and which appeared or went."""
    (v_old, a), (v_new, b) = read_table(old), read_table(new)
    out = [f"{c}: {a[c][0]} -> {b[c][0]} ({b[c][1][:160]})" for c in sorted(a.keys() & b.keys())
           if a[c][0] != b[c][0]]
    out += [f"{c}: new, {b[c][0]} ({b[c][1][:160]})" for c in sorted(b.keys() - a.keys())]
    out += [f"{c}: gone (was {a[c][0]})" for c in sorted(a.keys() - b.keys())]
    head = f"verdicts, transformers {v_old} ({old}) -> {v_new} ({new}): {len(out)} change(s)"
    return [head] + ["  " + line for line in out]


def _preload() -> None:
    """Import once, in the parent, what every rank would import lazily (DeepSpeed's optimizer check imports its
    Muon optimizer and with it torch.compile's stack: ~12 s per rank): the forked ranks share it."""
    import importlib

    for name in ("ds_wallfacer.integration", "deepspeed.runtime.engine", "deepspeed.runtime.zero.stage_1_and_2",
                 "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.utils"):
        try:
            importlib.import_module(name)
        except ImportError:  # another DeepSpeed release: it is only a head start
            pass


def run(only: list[str] | None = None, *, log: Any = sys.stdout) -> list[Row]:
    torch.set_num_threads(1)
    _preload()

    rows = []
    for model_type, cls in causal_lm_classes():
        if only and model_type not in only and cls not in only:
            continue
        row = sweep_one(model_type, cls)
        rows.append(row)
        print(f"{row.cls:40s} {row.verdict:14s} {row.seconds:5.1f}s {row.mode:9s} {row.detail[:150]}", file=log,
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.sweep.run", description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated model types or class names")
    p.add_argument("--write", default=None, help="write the markdown table here (e.g. docs/models.md)")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), default=None,
                   help="only print which classes changed verdict between two written tables")
    args = p.parse_args(argv)
    if args.compare:
        print("\n".join(compare_tables(*map(Path, args.compare))))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("WANDB_MODE", "offline")
    t0 = time.perf_counter()
    rows = run([s for s in args.only.split(",") if s] or None)
    if args.write:
        write_table(rows, Path(args.write))
    bad = [r for r in rows if r.verdict not in PASSING]
    print(f"{len(rows)} classes in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{v} {sum(r.verdict == v for r in rows)}" for v in dict.fromkeys(r.verdict for r in rows)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
