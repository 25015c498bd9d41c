"""The sweep's multimodal half: every image-text-to-text class of transformers (and every multimodal class of the
causal-LM mapping) given a batch with images, under sequence parallelism. Verdicts, as in ``run.py``:

- ``exact``: a class whose images train on shards (``adapters.vision.runs_images``: the M-RoPE classes of
  ``ADAPTED``, built by ``examples.vlm.tiny_vlm`` where it builds them, else by ``tiny_multimodal.build_tiny_vlm``,
  with a conversation in their token ids; every class with the placeholder pattern, built by
  ``tiny_multimodal.build_tiny_vlm`` with a row from its adapter's probed units), trained ``STEPS`` SGD steps on one
  row of text with two images (two units of each kind it takes) cut across shard boundaries on 4 CPU ranks (Ulysses
  2 x ring 2, ZeRO-1) against the same model on one process: loss within 1e-5 and every update within 1e-3;
- ``refused``: a batch with ``pixel_values`` handed to the loader (``prepare_batch`` with the adapter the
  integration would pass) is refused with a message naming the class and what its forward does, or ``initialize``
  refuses the class (its text path, or the start-up self-check with images);
- ``not buildable``: the class cannot be built tiny, or no batch with images can be built for it (its tower takes
  none of the probed layouts).

    python -m tests.sweep.multimodal [--only qwen2_5_vl,gemma3]
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
from typing import Any

import torch

from tests.dist_utils import run_distributed
from tests.sweep.run import LR, STEPS, WORLD, Row, _compare, _first_line
from tests.sweep.tiny import NotBuildable
from tests.sweep.tiny_multimodal import build_tiny_vlm, vlm_batch

MODE = {"mode": "hybrid", "ulysses_degree": 2, "ring_count": 1}
TIMEOUT_S = 180.0


def multimodal_classes() -> list[tuple[str, str]]:
    """(model_type, class name) of every image-text-to-text class and every ``*ForConditionalGeneration`` of the
    causal-LM mapping, each class once."""
    from transformers.models.auto import modeling_auto as ma

    pairs = list(ma.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items())
    pairs += [(t, c) for t, c in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if "ConditionalGeneration" in c]
    seen: dict[str, str] = {}
    for model_type, cls in pairs:
        seen.setdefault(cls, model_type)
    return sorted(((t, c) for c, t in seen.items()), key=lambda tc: tc[1])


def _build(model_type: str, cls: str) -> Any:
    """The tiny model: ``examples.vlm.tiny_vlm`` for the M-RoPE classes it builds, else
    ``tiny_multimodal.build_tiny_vlm``."""
    from ds_wallfacer.adapters.vision import ADAPTED
    from ds_wallfacer.examples.vlm import FAMILIES, tiny_vlm

    return tiny_vlm(ADAPTED[cls]) if ADAPTED.get(cls) in FAMILIES else build_tiny_vlm(model_type, cls)


def _batch(model: Any) -> dict[str, Any]:
    """One row of text with two images (two units of each kind the model takes) cut across shard boundaries."""
    from ds_wallfacer.adapters.vision import ADAPTED, vision_language
    from ds_wallfacer.examples.vlm import conversation, conversation_batch

    if type(model).__name__ not in ADAPTED:
        return vlm_batch(model)
    vision = vision_language(model)
    start, end = (getattr(model.config, k) if k else None for k in vision.family.bracket)
    tokens = (vision.image_token_id, vision.video_token_id, start, end)
    row = conversation(model, text=40, images=[(2, 3), (3, 2)], seed=7, tokens=tokens)
    batch = conversation_batch([row], token_ids=None)
    return {**batch, "mm_token_type_ids": vision.token_types(batch["input_ids"]).int()}


def _adapted(model: Any) -> bool:
    from ds_wallfacer.adapters.vision import runs_images

    return runs_images(model)


def _reference(model_type: str, cls: str) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    model = _build(model_type, cls)
    batch = _batch(model)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        out = model(**batch, labels=batch["input_ids"], use_cache=False)
        losses.append(out.loss.item())
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, start, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rank(rank: int, world: int, model_type: str, cls: str) -> tuple[str, Any]:
    import ds_wallfacer.integration as wfi
    from ds_wallfacer.audit.model_audit import RefusedModel

    try:
        model = _build(model_type, cls)
        config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0, "zero_optimization": {"stage": 1},
                  "zero_allow_untested_optimizer": True, "wallfacer": {"sequence_parallel_size": WORLD, **MODE}}
        try:
            engine, sp = wfi.initialize(model=model, config=config, optimizer=torch.optim.SGD(model.parameters(),
                                                                                                lr=LR))
        except RefusedModel as err:
            return "refused", str(err)
        batch, losses = _batch(model), []
        for _ in range(STEPS):
            loss = engine(**sp.shard(batch))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        params = {n: p.detach().numpy().copy() for n, p in sp.model.named_parameters()} if rank == 0 else None
        return "trained", (losses, params)
    except Exception:  # noqa: BLE001 - every failure reaches the parent as a verdict
        return "FAILED", traceback.format_exc(limit=6)


def _refusal(model: Any, cls: str) -> tuple[str, str]:
    """The loader's answer to a batch with pixels for a class without an adapter: (verdict, detail)."""
    from ds_wallfacer.adapters.vision import vision_language
    from ds_wallfacer.data.loader import ShardSpec, prepare_batch

    vision = vision_language(model)
    try:
        prepare_batch({"input_ids": torch.ones(1, 16, dtype=torch.long), "pixel_values": torch.zeros(1, 3, 8, 8)},
                      ShardSpec(index=0, sp_size=WORLD), vision=vision)
    except ValueError as err:
        msg = str(err)
        if vision is None:  # its forward takes no pixel_values: the loader's own refusal of image keys
            return "refused", f"takes no images (no vision config, no pixel_values in its forward); {msg}"
        if cls in msg:
            return "refused", msg.split(": ", 1)[1]
        return "FAILED", f"refused without naming the class: {msg}"
    return "WRONG", "a batch with pixel_values was sharded for a class without an adapter"


def sweep_one(model_type: str, cls: str) -> Row:
    t0 = time.perf_counter()
    row = Row(cls, model_type, "")
    try:
        model = _build(model_type, cls)
        if not _adapted(model):
            row.verdict, row.detail = _refusal(model, cls)
            return row
        ref = _reference(model_type, cls)
    except NotBuildable as err:
        row.verdict, row.detail = "not buildable", str(err)
        return row
    finally:
        row.seconds = time.perf_counter() - t0
    try:
        got = run_distributed(_rank, WORLD, model_type, cls, timeout_s=TIMEOUT_S, start_method="fork")
    except AssertionError as err:
        row.verdict = "HANG" if "did not finish" in str(err) else "FAILED"
        row.detail = str(err).splitlines()[0]
        return row
    row.seconds, row.mode = time.perf_counter() - t0, MODE["mode"]
    statuses = {s for s, _ in got}
    if statuses == {"trained"}:
        losses, params = got[0][1]
        row.verdict, row.detail = _compare(ref, losses, {n: torch.from_numpy(a) for n, a in params.items()})
    elif statuses == {"refused"}:
        row.verdict, row.detail = "refused", _first_line(got[0][1])
    else:
        row.verdict, row.detail = "FAILED", _first_line(next(p for s, p in got if s != "trained"))
    return row


def run(only: list[str] | None = None, *, log: Any = sys.stdout) -> list[Row]:
    from tests.sweep.run import _preload

    torch.set_num_threads(1)
    _preload()
    rows = []
    for model_type, cls in multimodal_classes():
        if only and model_type not in only and cls not in only:
            continue
        row = sweep_one(model_type, cls)
        rows.append(row)
        print(f"{row.cls:44s} {row.verdict:14s} {row.seconds:5.1f}s {row.detail[:150]}", file=log, flush=True)
    return rows


def table_lines(rows: list[Row]) -> list[str]:
    """The multimodal section of docs/models.md."""
    from tests.sweep.run import table_rows

    counts = {v: sum(r.verdict == v for r in rows) for v in dict.fromkeys(r.verdict for r in rows)}
    lines = [
        "",
        "## With images",
        "",
        "Every image-text-to-text class (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, and the multimodal classes of the",
        "causal-LM mapping) given a batch with images. **exact**: built tiny (`tests/sweep/tiny_multimodal.py`: small",
        "images, placeholder ids inside the tiny vocabulary, a few per-class sizes), trained 2 SGD steps on one row of",
        "text with two images (two of each kind of media the class takes) cut across shard boundaries on 4 CPU ranks",
        "(Ulysses 2 x ring 2, ZeRO-1) against the same model on one process, loss within 1e-5 and every update (the",
        "vision tower's included) within 1e-3. The M-RoPE classes run with their own 3-D positions; every other exact",
        "class has the placeholder pattern, recognised from its own code",
        "(Note [One adapter for the placeholder pattern] in docs/design/documents.md).",
        "**refused**: a batch with `pixel_values` is refused by the loader with what the class's forward does",
        "that no adapter reproduces (its own 3-D positions, its own attention masks, audio, ...), or `initialize`",
        "refuses the class (its language model, or the self-check); such a class still trains on text as the table",
        "above says. **not buildable**: it cannot be built tiny (the reason shown), or no batch with images can be built",
        "for it. " + ", ".join(f"{n} {v}" for v, n in counts.items()) + ".",
        "",
        *table_rows(rows),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    import os

    p = argparse.ArgumentParser(prog="python -m tests.sweep.multimodal", description=__doc__.split("\n")[0])
    p.add_argument("--only", default="", help="comma-separated model types or class names")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = run([s for s in args.only.split(",") if s] or None)
    from tests.sweep.run import PASSING

    print(", ".join(f"{v} {sum(r.verdict == v for r in rows)}" for v in dict.fromkeys(r.verdict for r in rows)))
    return 1 if any(r.verdict not in PASSING for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
