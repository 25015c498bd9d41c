"""The trainer's pieces that need no process group: data formats and the token cache, models from a directory /
config / preset, start-up refusals (every one before any process group exists), the resume choice, the schedule
and the data order."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_wallfacer.train import checkpoint as ckpt
from ds_wallfacer.train import main
from ds_wallfacer.train.cli import StartupError
from ds_wallfacer.train.data import load_token_data, train_batches
from ds_wallfacer.train.schedule import lr_factor
from ds_wallfacer.train.model import byte_tokenizer, load_model
from tests.train.helpers import ROOT, env, make_model_dir

DOCS = [p for p in (ROOT / "launch" / "data" / "sample.txt").read_text().split("\n\n") if p.strip()]


def _tokens(path: Path, cache: Path, **kw) -> "object":
    return load_token_data(path, byte_tokenizer(), tokenizer_id="bytes", eos_id=0, seq_len=64, eval_fraction=0.0,
                           cache_dir=cache, **kw)


def test_every_data_format_gives_the_same_sequences(tmp_path: Path) -> None:
    import datasets

    (tmp_path / "txt").mkdir()
    for i, d in enumerate(DOCS):
        (tmp_path / "txt" / f"doc{i:02d}.txt").write_text(d)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    ds = datasets.Dataset.from_dict({"text": DOCS})
    ds.to_parquet(str(tmp_path / "docs.parquet"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "saved"))
    stream = np.concatenate([np.frombuffer(d.encode() + b"\0", dtype=np.uint8) for d in DOCS]).astype(np.int32)
    want = stream[: len(stream) // 64 * 64].reshape(-1, 64)
    for src in ("txt", "docs.jsonl", "docs.parquet", "saved"):
        got = _tokens(tmp_path / src, tmp_path / "cache")
        np.testing.assert_array_equal(got.train, want, err_msg=src)
        assert not got.cache_hit and got.tokens == len(stream)


def test_token_cache_is_keyed_by_file_contents_and_text_field(tmp_path: Path) -> None:
    f = tmp_path / "docs.jsonl"
    f.write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
    with pytest.raises(StartupError, match="no column 'text'.*--text_field"):
        _tokens(f, tmp_path / "cache")
    first = _tokens(f, tmp_path / "cache", text_field="body")
    again = _tokens(f, tmp_path / "cache", text_field="body")
    assert again.cache_hit and np.array_equal(again.train, first.train)
    f.write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS[:3]))
    os.utime(f, ns=(1, 1))
    changed = _tokens(f, tmp_path / "cache", text_field="body")
    assert not changed.cache_hit and len(changed.train) < len(first.train)


def test_models_from_a_directory_a_config_or_a_preset(tmp_path: Path) -> None:
    import ds_wallfacer.integration  # noqa: F401  registers "wallfacer"

    d = make_model_dir(tmp_path / "m")
    pre = load_model(str(d), seq_len=128, dtype=torch.float32, seed=0)
    assert pre.source.startswith("pretrained:") and pre.tokenizer.eos_token_id == pre.eos_id == 1
    assert pre.model.config._attn_implementation == "wallfacer"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "config.json").write_text((d / "config.json").read_text())
    a = load_model(str(tmp_path / "c"), seq_len=128, dtype=torch.float32, seed=5)
    b = load_model(str(tmp_path / "c" / "config.json"), seq_len=128, dtype=torch.bfloat16, seed=5)
    assert a.source.startswith("config:") and a.tokenizer_id == "bytes"  # config only: byte-level tokenizer
    assert next(b.model.parameters()).dtype == torch.bfloat16
    for (n, x), (_, y) in zip(a.model.named_parameters(), b.model.named_parameters()):  # seeded identical init
        torch.testing.assert_close(x.to(torch.bfloat16), y, rtol=0, atol=0, msg=n)
    assert load_model("tiny-llama", seq_len=512, dtype=torch.float32, seed=0).source == "preset:tiny-llama"


def _refusal(capsys: pytest.CaptureFixture, *argv: str) -> str:
    assert main(list(argv)) == 2
    return capsys.readouterr().err


def test_start_up_refusals(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = ["--output_dir", str(tmp_path / "out")]
    err = _refusal(capsys, "--model", str(tmp_path / "missing"), *out)
    assert "--model" in err and "does not exist" in err
    err = _refusal(capsys, "--data", str(tmp_path / "missing.txt"), *out)
    assert "--data" in err and "does not exist" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.txt").write_text("")
    err = _refusal(capsys, "--data", str(tmp_path / "empty"), "--seq_len", "64", *out)
    assert "has 0 tokens, fewer than one sequence" in err
    (tmp_path / "nothing").mkdir()
    assert "holds no .txt/.jsonl/.parquet files" in _refusal(capsys, "--data", str(tmp_path / "nothing"), *out)
    err = _refusal(capsys, "--balance_steps", *out)
    assert "--balance_steps evens the documents' attention work, but without --document_masking" in err
    err = _refusal(capsys, "--seq_len", "10000", *out)  # tiny-llama: max_position_embeddings 8192
    assert "--seq_len 10000 is larger than the model's position limit max_position_embeddings = 8192" in err
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
                                 "num_hidden_layers": 1, "num_attention_heads": 4}))
    err = _refusal(capsys, "--model", str(small), *out)
    assert "the tokenizer has 256 tokens but the model's vocab_size is 100" in err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "wallfacer": {"ring_count": 0}}))
    err = _refusal(capsys, "--deepspeed_config", str(bad), *out)
    assert "wallfacer.ring_count = 0 is invalid" in err
    bad.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "wallfacer": {"balance_steps": True}}))
    err = _refusal(capsys, "--deepspeed_config", str(bad), *out)
    assert "wallfacer.balance_steps = true evens the documents' attention work, but without --document_masking" in err


def test_an_option_the_ds_config_sets_otherwise_is_refused_before_anything_runs(tmp_path: Path,
                                                                               capsys: pytest.CaptureFixture) -> None:
    # every shipped config with an optimizer sets lr 3e-3 (or 1e-5): --lr used to be dropped there without a word
    err = _refusal(capsys, "--deepspeed_config", "wallfacer", "--lr", "1e4", "--steps", "8", "--output_dir",
                   str(tmp_path / "out"))
    assert len(err.splitlines()) == 1 and err.startswith("ds_wallfacer.train: error: --deepspeed_config ")
    assert ("--lr 10000 and the ds_config's optimizer.params.lr = 0.003 disagree: drop --lr, or in the ds_config "
            'change optimizer.params.lr to 10000, remove it or set it to "auto"') in err
    assert not (tmp_path / "out").exists()  # no model, token cache or checkpoint yet


def test_an_option_fills_a_ds_config_key_left_auto(tmp_path: Path) -> None:
    from tests.train.helpers import losses, summary, train_on_ranks

    cfg = tmp_path / "auto.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "torch_adam": True}},
        "wallfacer": {"sequence_parallel_size": 1, "self_check": False},
    }))
    out = tmp_path / "out"
    res = train_on_ranks(1, tmp_path, "--deepspeed_config", str(cfg), "--lr", "1e-4", "--lr_decay", "constant",
                         "--steps", "2", "--seq_len", "64", "--eval_fraction", "0", "--no_wandb", "--no_export",
                         "--no_save", "--watchdog_timeout", "0", "--output_dir", str(out))
    summary(res)
    assert "ds_wallfacer.train: options: lr = 0.0001 <- --lr (written to optimizer.params.lr); steps = 2 <- --steps" \
        in res.stdout, res.stdout[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == [1e-4, 1e-4] and len(losses(out)) == 2
    # a DeepSpeed scheduler left "auto" gets the options' values (DeepSpeed would refuse "auto" itself)
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "total_num_steps": "auto",
                                                           "warmup_num_steps": "auto", "warmup_type": "linear"}},
        "wallfacer": {"sequence_parallel_size": 1, "self_check": False},
    }))
    res = train_on_ranks(1, tmp_path, "--deepspeed_config", str(cfg), "--lr", "1e-3", "--warmup_steps", "2",
                         "--steps", "5", "--seq_len", "64", "--eval_fraction", "0", "--no_wandb", "--no_export",
                         "--no_save", "--watchdog_timeout", "0", "--output_dir", str(tmp_path / "sched"))
    summary(res)
    assert "steps = 5 <- --steps (written to scheduler.params.total_num_steps)" in res.stdout, res.stdout[-3000:]
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "sched" / "metrics.jsonl").read_text().splitlines()]
    assert max(lrs) == pytest.approx(1e-3) and lrs[-1] < 1e-3, lrs


def test_shipped_examples_are_the_defaults_and_found_by_name(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from ds_wallfacer import examples
    from ds_wallfacer.train.cli import DEFAULT_CONFIG, DEFAULT_DATA, parse_args

    # the package holds the files; the checkout's ds_configs/ and launch/data/ lead to the same ones
    assert DEFAULT_CONFIG.is_file() and (DEFAULT_DATA / "sample.txt").is_file()
    assert (ROOT / "ds_configs" / "wallfacer.json").resolve() == DEFAULT_CONFIG.resolve()
    assert (ROOT / "launch" / "data").resolve() == DEFAULT_DATA.resolve()
    args = parse_args(["--deepspeed_config", "hybrid", "--output_dir", str(tmp_path)])
    assert Path(args.deepspeed_config) == examples.CONFIG_DIR / "hybrid.json"
    assert parse_args(["--deepspeed_config", "hybrid.json"]).deepspeed_config == args.deepspeed_config
    assert examples.find_config("./hybrid") is None  # a path, not a name
    err = _refusal(capsys, "--deepspeed_config", "hybird", "--output_dir", str(tmp_path))
    assert ("--deepspeed_config 'hybird' does not exist (nor is it a shipped example: hybrid, llama3_8b_h100_800k, "
            "llama3_8b_h200_1p5m, main,") in err


def test_refusal_exits_non_zero_with_one_line(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "ds_wallfacer.train", "--data", str(tmp_path / "nope")], cwd=ROOT,
                         env=env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert f"ds_wallfacer.train: error: --data {str(tmp_path / 'nope')!r} does not exist" in res.stderr
    assert "Traceback" not in res.stderr


def _tag(root: Path, step: int, *, complete: bool) -> None:
    (root / f"step_{step}").mkdir(parents=True)
    if complete:
        (root / f"step_{step}" / ckpt.MARKER).write_text(json.dumps({"step": step}))


def test_resume_never_picks_an_incomplete_save(tmp_path: Path) -> None:
    root = tmp_path / "out" / "checkpoints"
    assert ckpt.resolve_resume("auto", tmp_path / "out") is None  # nothing yet: start fresh
    _tag(root, 5, complete=True)
    _tag(root, 10, complete=True)
    _tag(root, 15, complete=False)  # interrupted
    (root / "latest").write_text("step_15")
    assert ckpt.resolve_resume("auto", tmp_path / "out") == root / "step_10"
    (root / "latest").write_text("step_5")
    assert ckpt.find_resume(root) == root / "step_5"  # the pointer wins when complete
    (root / "latest").unlink()
    assert ckpt.find_resume(root) == root / "step_10"
    assert ckpt.resolve_resume(str(root), tmp_path) == root / "step_10"
    with pytest.raises(StartupError, match="not a complete checkpoint"):
        ckpt.resolve_resume(str(root / "step_15"), tmp_path)


def test_schedule_and_data_order() -> None:
    f = lr_factor(steps=10, warmup_steps=2, decay="cosine", min_ratio=0.1)
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0] and f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
    assert lr_factor(steps=10, warmup_steps=0, decay="linear", min_ratio=0.0)(5) == pytest.approx(0.5)
    seqs = np.arange(11 * 4).reshape(11, 4)
    # the same global batch split two ways: step k holds the same sequences
    one = [b["input_ids"] for b in train_batches(seqs, micro=2, dp=1, epoch=1, seed=7)]
    two = [b["input_ids"] for b in train_batches(seqs, micro=1, dp=2, epoch=1, seed=7)]
    assert len(one) == 5 and len(two) == 10
    for k in range(5):
        assert torch.equal(one[k], torch.cat(two[2 * k : 2 * k + 2]))
    tail = [b["input_ids"] for b in train_batches(seqs, micro=1, dp=2, epoch=1, seed=7, start=4)]
    assert all(torch.equal(x, y) for x, y in zip(tail, two[4:])) and len(tail) == 6
    other = [b["input_ids"] for b in train_batches(seqs, micro=2, dp=1, epoch=2, seed=7)]
    assert not all(torch.equal(x, y) for x, y in zip(one, other))  # reshuffled per epoch


def test_a_refused_model_ends_the_launch_with_one_line_and_status_2(tmp_path: Path) -> None:
    from tests.sweep.tiny import build_tiny
    from tests.train.helpers import launch

    cfg = build_tiny("llama", "LlamaForCausalLM", check=False).config
    cfg.vocab_size = 256  # the byte tokenizer's
    cfg.attention_dropout = 0.1  # each rank would draw its own mask: refused
    cfg.to_json_file(str(tmp_path / "config.json"))
    res = launch(2, tmp_path, "--model", str(tmp_path / "config.json"), "--seq_len", "64", "--steps", "1",
                 "--no_wandb", "--output_dir", str(tmp_path / "out"))
    out = res.stdout + res.stderr
    assert res.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "ds_wallfacer.train: error:" in line]
    assert len(errors) == 1, out[-3000:]
    assert "LlamaForCausalLM cannot be trained exactly" in errors[0] and "attention_dropout=0.1" in out
    assert "Traceback" not in out
