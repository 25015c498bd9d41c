"""``WallfacerTrainer`` with ``"balance_steps": true`` on 2 data-parallel replicas x 2 sequence-parallel ranks: the
ranks of a group draw the same packed micro-batches, the replicas disjoint ones of near-equal attention work (where
the Trainer's random order is uneven), every item once per epoch, and it trains."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("accelerate")

# imported once in the parent so the forked ranks share them (see test_trainer_parity.py)
import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: E402,F401
import transformers.trainer  # noqa: E402,F401

from tests.dist_utils import run_distributed  # noqa: E402

from .runs import ds_config, token_sequences  # noqa: E402

ITEMS, MICRO = 32, 2


def _draws(rank: int, world: int, out: str, balance: bool) -> dict[str, Any]:
    """One epoch of this rank's training loader (each micro-batch as its documents' lengths), then 2 steps."""
    from transformers import DataCollatorWithFlattening, TrainingArguments

    from ds_wallfacer.hf_trainer import WallfacerTrainer
    from tests.models import tiny_model

    section = {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 2, "balance_steps": balance}
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=1, max_steps=2,
        learning_rate=0.1, max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
        deepspeed=ds_config(section), use_cpu=True, save_strategy="no",
    )
    trainer = WallfacerTrainer(model=tiny_model("llama", seed=0), args=args, data_collator=DataCollatorWithFlattening(),
                               train_dataset=token_sequences(ITEMS, seed=1))
    batches = []
    for b in trainer.get_train_dataloader():
        n = b["input_ids"].shape[1] * 2  # the full row: this rank holds 1 / P of it
        starts = sorted({int(s) for s in b["document_starts"][0] if s < n})  # the tail is filled with n
        batches.append([y - x for x, y in zip(starts, [*starts[1:], n])])  # the last: padding to a multiple of 2P
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"batches": batches, "losses": losses, "dp_rank": trainer.sequence_parallel.groups.shard_spec.dp_rank}


def _round_ratios(ranks: list[dict]) -> list[float]:
    by_replica = {r["dp_rank"]: r["batches"] for r in ranks}
    work = {d: [sum(x * (x + 1) // 2 for x in b) for b in batches] for d, batches in by_replica.items()}
    return [max(pair) / (sum(pair) / 2) for pair in zip(work[0], work[1])]


def test_replicas_draw_rounds_of_even_attention_work(tmp_path: Path) -> None:
    lengths = sorted(len(s["input_ids"]) for s in token_sequences(ITEMS, seed=1))
    ratios = {}
    for balance in (False, True):
        ranks = run_distributed(_draws, 4, str(tmp_path / str(balance)), balance, timeout_s=240)
        groups: dict[int, list] = {}
        for r in ranks:
            groups.setdefault(r["dp_rank"], []).append(r["batches"])
        assert sorted(groups) == [0, 1] and all(a == b for a, b in groups.values())  # a group draws one stream
        drawn = sorted(x for d in (0, 1) for b in groups[d][0] for x in b if x >= 64)  # not the padding
        assert drawn == lengths, (balance, drawn, lengths)  # every item once per epoch
        assert all(loss == loss and loss < 10 for loss in ranks[0]["losses"]), ranks[0]["losses"]
        ratios[balance] = _round_ratios(ranks)
        assert len(ratios[balance]) == ITEMS // (2 * MICRO)
    # two items of 64-128 tokens per micro-batch: the random order is 1.07x even on average, the balanced one
    # within 5 % in every round
    assert max(ratios[True]) <= 1.05 < sum(ratios[False]) / len(ratios[False]), ratios
