"""The trainer on the shipped image conversations (``ds_wallfacer/examples/vlm_chat``: tiny PNGs and a JSONL of
TRL-style ``{"messages", "images"}`` rows) with a tiny LLaVA folder and its processor: WallFacer C = 2 on 4 ranks
equals the same trainer on one rank at every step and in the eval loss (fp32, SGD, no clipping, gradient
accumulation 2), and the export carries the processor. The rows themselves (``train/conversations.py``) are checked
without processes: the processor's image tokens and pixels, the loss on assistant turns only, the refusals."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ds_wallfacer.examples.vlm_chat import VLM_CHAT_DIR, chat_processor, save_vlm_folder

from .helpers import summary, train_on_ranks

DATA = VLM_CHAT_DIR / "chat.jsonl"


def test_conversation_rows_carry_their_images_and_assistant_labels() -> None:
    from ds_wallfacer.train.cli import StartupError
    from ds_wallfacer.train.conversations import is_conversation_file, load_conversations

    assert is_conversation_file(DATA) and not is_conversation_file(VLM_CHAT_DIR / "images" / "red_dot.png")
    processor = chat_processor()
    data = load_conversations(DATA, processor, seq_len=64, eval_fraction=0.25)
    assert len(data.train) == 18 and len(data.eval) == 6, (len(data.train), len(data.eval))
    image_id = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    batch = data.train[[2, 0]]  # conversation 2 has two images, conversation 0 one
    assert batch["input_ids"].shape == (2, 64) and batch["pixel_values"].shape == (3, 3, 28, 28), batch
    assert [int((r == image_id).sum()) for r in batch["input_ids"]] == [8, 4]
    assert batch["attention_mask"].sum(1).tolist() == [data.train.lengths[2], data.train.lengths[0]]
    eos = processor.tokenizer.eos_token_id
    for ids, labels in zip(batch["input_ids"], batch["labels"]):  # the reply and its end are the targets
        kept = ids[labels != -100].tolist()
        assert kept and kept[-1] == eos and image_id not in kept, kept
    with pytest.raises(StartupError, match="line 1: the conversation is .* more than --seq_len 16"):
        load_conversations(DATA, processor, seq_len=16, eval_fraction=0)


def _config(path: Path, wallfacer: dict) -> Path:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0,
        "zero_optimization": {"stage": 2}, "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_allow_untested_optimizer": True, "wallfacer": wallfacer,
    }))
    return path


def test_image_conversations_train_on_four_ranks_as_on_one(tmp_path: Path) -> None:
    model = save_vlm_folder(tmp_path / "model")
    runs = {}
    for name, ranks, section in (("p1", 1, {"sequence_parallel_size": "auto"}),
                                 ("p4", 4, {"sequence_parallel_size": 4, "mode": "wallfacer", "ring_count": 2})):
        out = tmp_path / name
        out.mkdir()
        res = train_on_ranks(ranks, tmp_path, "--deepspeed_config", str(_config(out / "ds.json", section)),
                             "--model", str(model), "--data", str(DATA), "--seq_len", "64", "--steps", "4",
                             "--eval_fraction", "0.25", "--eval_every", "2", "--output_dir", str(out), "--no_wandb",
                             *(("--no_export",) if ranks == 1 else ()))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (summary(res), {r["step"]: r for r in rows})
    (one, ref), (four, got) = runs["p1"], runs["p4"]
    assert four["sequence_parallel_size"] == 4 and sorted(ref) == sorted(got) == [1, 2, 3, 4], (four, got)
    for step, want in ref.items():
        assert math.isfinite(want["loss"]), want
        for key in ("loss", "eval_loss"):
            if key in want:
                assert got[step][key] == pytest.approx(want[key], rel=2e-5, abs=2e-5), (step, key, got[step], want)
    assert "eval_loss" in got[4] and "eval_loss" in got[2], got
    assert got[1]["comm/vision/all_gather"] > 0, got[1]  # the group split the tower's work on the images
    assert (tmp_path / "p4" / "hf_model" / "processor_config.json").is_file()
