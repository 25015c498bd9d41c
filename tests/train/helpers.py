"""Running the trainer, through the real ``deepspeed`` launcher or on ranks forked from the test process, and
reading what it wrote (offline wandb runs, metrics.jsonl, the summary line)."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or shutil.which("deepspeed")
TRAIN = ROOT / "launch" / "train.py"


def env() -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
    if not shutil.which("nvidia-smi"):
        e["DS_ACCELERATOR"] = "cpu"
    return e


def launch(num: int, cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``deepspeed --num_gpus num launch/train.py args...``; asserts nothing."""
    from tests.dist_utils import free_port

    assert DEEPSPEED is not None
    cmd = [DEEPSPEED, "--num_gpus", str(num), "--master_port", str(free_port()), str(TRAIN), "--no_progress", *args]
    return subprocess.run(cmd, cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def _trainer_rank(rank: int, world: int, cwd: Path, argv: tuple[str, ...]) -> tuple[int, str, str]:
    import contextlib
    import io

    from ds_wallfacer.train.loop import main

    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["--no_progress", *argv])
    return status, out.getvalue(), err.getvalue()


def train_on_ranks(num: int, cwd: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """The trainer's ``main`` on ``num`` gloo ranks forked from this process (``tests.dist_utils``): what the
    launcher's ranks run, without the launcher and the imports of a fresh interpreter per rank (for tests that
    compare what runs train, not how they start). The first non-zero exit status of a rank, and rank 0's output
    (what ``sys.stdout`` and ``sys.stderr`` got), as ``launch`` returns them."""
    from tests.dist_utils import run_distributed

    ranks = run_distributed(_trainer_rank, num, cwd, args, timeout_s=timeout)
    status = next((s for s, _, _ in ranks if s), 0)
    return subprocess.CompletedProcess(args=list(args), returncode=status, stdout=ranks[0][1], stderr=ranks[0][2])


def summary(res: subprocess.CompletedProcess) -> dict[str, Any]:
    """The JSON line the trainer prints last (rank 0); fails with the output's tail when the run failed."""
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("{")]
    assert lines, out[-5000:]
    return json.loads(lines[-1])


def losses(output_dir: Path) -> dict[int, float]:
    """Step -> training loss from ``metrics.jsonl`` (exact floats; later lines win, as after a resume)."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The history rows of an offline wandb run, read from its ``run-*.wandb`` file (wandb's record log:
    a 7-byte header, then 32 KiB blocks of records, each with a 7-byte header: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    block, pos, payload, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full or last piece
            rec = pb.Record()
            rec.ParseFromString(payload)
            payload = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def make_model_dir(path: Path) -> Path:
    """A tiny Llama (tests/integration/models.py) saved with ``save_pretrained`` and, beside it, a word-level BPE
    tokenizer trained offline on the bundled text (vocabulary 200 < the model's 256, with an EOS token)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.integration.models import tiny_model

    tiny_model("llama", seed=0).save_pretrained(str(path))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([(ROOT / "launch" / "data" / "sample.txt").read_text()],
                            trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    fast.save_pretrained(str(path))
    return path


def jsonl_docs(path: Path, tokenizer, *, tokens: int) -> Path:
    """The bundled text's paragraphs as a .jsonl (field "text"), as many as give about ``tokens`` tokens."""
    docs, n = [], 0
    for para in (ROOT / "launch" / "data" / "sample.txt").read_text().split("\n\n"):
        if not para.strip():
            continue
        docs.append(para)
        n += len(tokenizer(para, add_special_tokens=False)["input_ids"]) + 1
        if n >= tokens:
            break
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def p2_trainer_args(tmp: Path, *, steps: int) -> list[str]:
    """Options of a small 2-rank trainer run under ``tmp``: a saved tiny Llama with its tokenizer, .jsonl documents
    of about 5 x 128 tokens, a ZeRO-2 ring config (P = 2, two sequences of 128 tokens per step), ``steps`` steps,
    no wandb, no export, no evaluation (the checkpoint tests' common run)."""
    from transformers import AutoTokenizer

    model_dir = make_model_dir(tmp / "model")
    data = jsonl_docs(tmp / "docs.jsonl", AutoTokenizer.from_pretrained(str(model_dir)), tokens=5 * 128)
    cfg = tmp / "p2.json"
    cfg.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2}, "steps_per_print": 1000,
        "wallfacer": {"sequence_parallel_size": 2, "mode": "wallfacer", "ring_count": 1},
    }))
    (tmp / "cwd").mkdir(exist_ok=True)
    return ["--deepspeed_config", str(cfg), "--model", str(model_dir), "--data", str(data), "--seq_len", "128",
            "--steps", str(steps), "--eval_fraction", "0", "--seed", "3", "--cache_dir", str(tmp / "cache"),
            "--no_wandb", "--no_export"]
