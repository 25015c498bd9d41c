"""The trainer's 10-step loss curves under every sequence-parallel mode equal the run without sequence parallelism.

Ring (C = 1), multi-ring WallFacer (C = 2), Ulysses (U = 4) and the hybrid (U = 2 x ring) on 4 ranks, each
against the same trainer on one rank (P = 1: local attention, no collective), with the bundled data. The ranks are
forked from the test process (``helpers.train_on_ranks``); the launcher's own path is tested in
``tests/integration/test_launcher.py`` and the other files here. fp32, SGD, no gradient clipping: a gradient off by a constant factor changes the
curve (Adam and clipping would hide it). Every run sees the same batches in the same order (one sequence-parallel
group, the same seed), so the losses must agree to fp32 noise at every step.
"""
from __future__ import annotations

import json
from pathlib import Path

from .helpers import losses, summary, train_on_ranks

STEPS = 10
MODES = {
    "ring": {"mode": "wallfacer", "ring_count": 1},
    "wallfacer-C2": {"mode": "wallfacer", "ring_count": 2},
    "ulysses": {"mode": "ulysses"},
    "hybrid": {"mode": "hybrid", "ulysses_degree": 2},
}


def _config(path: Path, wallfacer: dict) -> Path:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_allow_untested_optimizer": True,
        "wallfacer": {"sequence_parallel_size": "auto" if not wallfacer else 4, **wallfacer},
    }))
    return path


def _run(tmp_path: Path, name: str, ranks: int, wallfacer: dict) -> tuple[dict, dict[int, float]]:
    out = tmp_path / name
    out.mkdir()
    res = train_on_ranks(ranks, tmp_path, "--deepspeed_config", str(_config(out / "ds.json", wallfacer)),
                 "--steps", str(STEPS), "--seq_len", "64", "--output_dir", str(out), "--cache_dir",
                 str(tmp_path / "cache"), "--no_wandb", "--no_save", "--no_export", "--eval_every", "1000")
    return summary(res), losses(out)


def test_loss_curves_of_every_mode_equal_the_run_without_sequence_parallelism(tmp_path: Path) -> None:
    _, reference = _run(tmp_path, "p1", 1, {})
    assert len(reference) == STEPS
    assert reference[max(reference)] < reference[min(reference)]  # it learns
    failures = []
    for name, section in MODES.items():
        info, curve = _run(tmp_path, name, 4, section)
        assert info["sequence_parallel_size"] == 4, info
        for step, want in reference.items():
            got = curve[step]
            if abs(got - want) > 2e-5 * max(1.0, abs(want)):
                failures.append(f"{name} step {step}: loss {got:.7f} != {want:.7f} without sequence parallelism")
    assert not failures, "\n".join(failures)


def _short_docs(path: Path) -> Path:
    """The bundled text as one short document per sentence (20-200 bytes), so a 64-token sequence packs several."""
    text = (Path(__file__).resolve().parents[2] / "launch" / "data" / "sample.txt").read_text()
    docs = [s.strip() + "." for s in text.replace("\n", " ").split(".") if len(s.strip()) > 20]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def test_document_masking_curves_equal_across_modes_and_differ_from_one_stream(tmp_path: Path) -> None:
    """--document_masking: every document attends only to itself. Ring with balanced sharding and Ulysses on 4
    ranks equal the one-rank run step by step; the plain stream (documents see each other) differs."""
    data = _short_docs(tmp_path / "docs.jsonl")

    def run(name: str, ranks: int, section: dict, *extra: str) -> dict[int, float]:
        out = tmp_path / name
        out.mkdir()
        res = train_on_ranks(ranks, tmp_path, "--deepspeed_config", str(_config(out / "ds.json", section)),
                     "--steps", "4", "--seq_len", "64", "--data", str(data), "--output_dir", str(out), "--cache_dir",
                     str(tmp_path / "cache"), "--no_wandb", "--no_save", "--no_export", "--eval_every", "1000", *extra)
        summary(res)
        return losses(out)

    reference = run("p1", 1, {}, "--document_masking")
    stream = run("p1-stream", 1, {})
    assert max(abs(reference[s] - stream[s]) for s in reference) > 1e-3, (reference, stream)
    for name, section in {"ring-balanced": {"mode": "wallfacer", "ring_count": 1, "sharding": "balanced"},
                          "ulysses": {"mode": "ulysses"}}.items():
        curve = run(name, 4, section, "--document_masking")
        for step, want in reference.items():
            assert abs(curve[step] - want) <= 2e-5 * max(1.0, abs(want)), (name, step, curve[step], want)


def test_balance_steps_evens_the_replicas_attention_work(tmp_path: Path) -> None:
    """--balance_steps on 2 replicas x 2 sequence-parallel ranks: rounds pair rows of near-equal attention work
    (the logged ``attention_work_imbalance``), where the shuffled order does not; the run trains."""
    data = _short_docs(tmp_path / "docs.jsonl")

    def run(name: str, *extra: str) -> list[dict]:
        out = tmp_path / name
        out.mkdir()
        section = {"mode": "wallfacer", "ring_count": 1, "sequence_parallel_size": 2}
        res = train_on_ranks(4, tmp_path, "--deepspeed_config", str(_config(out / "ds.json", section)),
                             "--steps", "6", "--seq_len", "128", "--data", str(data), "--output_dir", str(out),
                             "--cache_dir", str(tmp_path / "cache"), "--no_wandb", "--no_save", "--no_export",
                             "--eval_every", "1000", "--document_masking", *extra)
        assert summary(res)["data_parallel_size"] == 2
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    plain, balanced = run("shuffled"), run("balanced", "--balance_steps")
    ratios = [[r["attention_work_imbalance"] for r in rows] for rows in (plain, balanced)]
    # a small corpus has few rows of the largest works, so the odd round stays uneven: compare the means
    assert sum(ratios[1]) / 6 <= 1.05 < sum(ratios[0]) / 6, ratios
    assert all(r["loss"] < 10 for r in balanced), balanced


def test_dynamic_sequence_parallelism_trains_documents_like_one_rank_and_resumes_exactly(tmp_path: Path) -> None:
    """wallfacer.dynamic_sequence_parallel: every document a row of its own length, each on the group size it needs.
    On 4 ranks the curve equals the same trainer on one rank (the same rows and steps, no sequence parallelism),
    and a run resumed from its step-2 checkpoint continues it exactly."""
    data = _short_docs(tmp_path / "docs.jsonl")

    def run(name: str, ranks: int, steps: int, *extra: str) -> dict[int, float]:
        out = tmp_path / name
        out.mkdir(exist_ok=True)
        # 4 ranks: rows of up to 64 tokens on groups of 1, 2 (Ulysses) or 4 (hybrid); 1 rank: every row alone
        section = ({"mode": "hybrid", "ulysses_degree": 2} if ranks > 1 else {"mode": "wallfacer"}) | {
            "sequence_parallel_size": ranks, "dynamic_sequence_parallel": {"max_tokens_per_rank": 64 // ranks}}
        cfg = json.loads(_config(out / "ds.json", section).read_text())
        cfg["gradient_accumulation_steps"] = 6
        (out / "ds.json").write_text(json.dumps(cfg))
        res = train_on_ranks(ranks, tmp_path, "--deepspeed_config", str(out / "ds.json"), "--steps", str(steps),
                             "--seq_len", "64", "--data", str(data), "--output_dir", str(out), "--cache_dir",
                             str(tmp_path / "cache"), "--no_wandb", "--no_export", "--eval_every", "1000",
                             "--lr_decay", "constant", *extra)  # the same rate whatever --steps says
        summary(res)
        return losses(out)

    reference = run("p1", 1, 4, "--no_save")
    curve = run("p4", 4, 4, "--save_every", "2")
    for step, want in reference.items():
        assert abs(curve[step] - want) <= 2e-5 * max(1.0, abs(want)), (step, curve, reference)
    resumed = run("resumed", 4, 4, "--resume", str(tmp_path / "p4" / "checkpoints" / "step_2"), "--no_save")
    assert [resumed[s] for s in (3, 4)] == [curve[s] for s in (3, 4)], (resumed, curve)
