"""Work-balanced steps: the order keeps every row once, balances each round's replicas, resumes exactly, and the
loader's and the trainer's data paths follow it. Pure (no process group)."""
from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from ds_wallfacer.data import SequenceParallelLoader, ShardSpec
from ds_wallfacer.data.loader import item_work
from ds_wallfacer.data.steps import balanced_order, idle_share, round_balance, row_work
from ds_wallfacer.train.data import row_works, train_batches
from ds_wallfacer.train.order import resume_order_error
from benchmarks.document_mix import lognormal_document_mix


def _works(rows: int, seq_len: int, seed: int = 1) -> list[int]:
    return [row_work(r) for r in lognormal_document_mix(seed=seed, rows=rows, seq_len=seq_len, median=seq_len / 4)]


def test_row_work_is_the_documents_causal_squares() -> None:
    assert row_work([3, 2]) == 6 + 3
    assert row_work([10], window=4) == 10 + 6 * 4  # 1+2+3+4, then 4 per key
    assert row_work([]) == 0


@pytest.mark.parametrize("per_replica,replicas,window", [(1, 4, None), (2, 4, None), (1, 8, 16), (3, 2, 5)])
def test_order_keeps_each_row_once_within_its_window(per_replica: int, replicas: int, window: int | None) -> None:
    work = _works(203, 1024)
    per_round = per_replica * replicas
    order = balanced_order(work, per_replica=per_replica, replicas=replicas, seed=3, window=window)
    end = len(work) // per_round * per_round
    assert sorted(order) == list(range(end))  # the tail short of a round is left out, like the epoch's
    if window is not None:
        span = window * per_round
        assert all(order[k] // span == k // span for k in range(end))  # rows stay in their window
    assert order == balanced_order(work, per_replica=per_replica, replicas=replicas, seed=3, window=window)


@pytest.mark.parametrize("seq_len,replicas,per_replica", [(8192, 4, 1), (32768, 8, 1), (8192, 4, 2)])
def test_rounds_balance_within_5_percent_where_arrival_order_does_not(seq_len: int, replicas: int,
                                                                     per_replica: int) -> None:
    work = _works(1024, seq_len)
    arrival = round_balance(work, list(range(len(work))), per_replica=per_replica, replicas=replicas)
    ratios = round_balance(work, balanced_order(work, per_replica=per_replica, replicas=replicas, seed=0),
                           per_replica=per_replica, replicas=replicas)
    assert statistics.mean(arrival) > 1.3
    assert statistics.mean(ratios) <= 1.02
    assert sum(r <= 1.05 for r in ratios) >= 0.95 * len(ratios)
    order = balanced_order(work, per_replica=per_replica, replicas=replicas, seed=0)
    arrived = list(range(len(work)))
    assert idle_share(work, order, per_replica=per_replica, replicas=replicas) <= 0.01
    assert idle_share(work, arrived, per_replica=per_replica, replicas=replicas) > 0.2


def test_idle_share_counts_the_wait_for_the_busiest_replica() -> None:
    # rounds of 2 replicas: (3, 1) waits 2 of 6, (2, 2) waits 0 of 4
    assert idle_share([3, 1, 2, 2], [0, 1, 2, 3], per_replica=1, replicas=2) == pytest.approx(2 / 10)
    assert round_balance([3, 1, 2, 2], [0, 1, 2, 3], per_replica=1, replicas=2) == [1.5, 1.0]


def test_rounds_are_shuffled_not_sorted() -> None:
    work = _works(400, 4096)
    order = balanced_order(work, per_replica=1, replicas=4, seed=0)
    loads = [sum(work[r] for r in order[a : a + 4]) for a in range(0, len(order), 4)]
    assert loads != sorted(loads) and loads != sorted(loads, reverse=True)
    assert order != balanced_order(work, per_replica=1, replicas=4, seed=1)


def test_largest_first_onto_the_least_loaded_replica() -> None:
    work = [10, 1, 9, 2, 8, 3]  # one round of 3 replicas x 2 rows
    order = balanced_order(work, per_replica=2, replicas=3, seed=0)
    assert [sum(work[r] for r in order[d * 2 : d * 2 + 2]) for d in range(3)] == [11, 11, 11]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="window = 0 is invalid"):
        balanced_order([1, 2], per_replica=1, replicas=2, seed=0, window=0)
    with pytest.raises(ValueError, match="row work -1 is invalid"):
        balanced_order([1, -1], per_replica=1, replicas=2, seed=0)
    with pytest.raises(ValueError, match="must be positive"):
        balanced_order([1, 2], per_replica=0, replicas=2, seed=0)


def _token_rows(rows: int, seq_len: int, eos: int) -> np.ndarray:
    """Rows of a token stream whose documents end with ``eos``, lengths log-normal."""
    out = np.ones((rows, seq_len), dtype=np.int64)
    for i, docs in enumerate(lognormal_document_mix(seed=5, rows=rows, seq_len=seq_len, median=seq_len / 4,
                                                   min_len=2)):
        ends = np.cumsum(docs) - 1
        out[i, ends[:-1]] = eos  # the last document is cut by the row end
    return out


def test_trainer_rounds_are_balanced_and_resume_exactly() -> None:
    seqs, micro, dp = _token_rows(96, 256, eos=0), 2, 3
    work = row_works(seqs, 0)
    full = train_batches(seqs, micro=micro, dp=dp, epoch=2, seed=7, eos_id=0, work=work)
    plain = train_batches(seqs, micro=micro, dp=dp, epoch=2, seed=7, eos_id=0)
    assert sorted(full.order.tolist()) == sorted(plain.order.tolist())  # the same rows, in another order
    balanced = round_balance(work, full.order.tolist(), per_replica=micro, replicas=dp)
    arrival = round_balance(work, plain.order.tolist(), per_replica=micro, replicas=dp)
    assert max(balanced) < 1.1 < statistics.mean(arrival), (max(balanced), statistics.mean(arrival))
    batches = list(full)
    for j, b in enumerate(batches):  # batch j: replica j % dp's rows of round j // dp
        assert torch.equal(b["input_ids"], torch.from_numpy(seqs[full.order[j * micro : (j + 1) * micro]]))
    resumed = list(train_batches(seqs, micro=micro, dp=dp, epoch=2, seed=7, start=4 * micro * dp, eos_id=0,
                                 work=work))
    assert len(resumed) == len(batches) - 4 * dp
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(resumed, batches[4 * dp :]))


def test_a_resume_in_another_order_is_refused_mid_epoch() -> None:
    assert resume_order_error(6, 6, 12) is None and resume_order_error(0, 0, 12) is None
    assert resume_order_error(6, 4, 0) is None  # an epoch boundary: any order may start
    assert "work-balanced rounds of 6 rows, but this run orders the epoch in work-balanced rounds of 4 rows" in \
        resume_order_error(6, 4, 12)
    assert "in the plain shuffle, but this run orders the epoch in work-balanced rounds of 6" in \
        resume_order_error(0, 6, 12)
    # a balanced epoch resumed in another split would repeat rows: what the refusal prevents
    seqs = _token_rows(48, 128, eos=0)
    work = row_works(seqs, 0)
    a = train_batches(seqs, micro=1, dp=6, epoch=0, seed=0, eos_id=0, work=work).order[:12].tolist()
    b = train_batches(seqs, micro=1, dp=4, epoch=0, seed=0, eos_id=0, work=work).order[12:].tolist()
    assert set(a) & set(b)


def _packed_items(count: int, seq_len: int) -> list[dict]:
    items = []
    for i, docs in enumerate(lognormal_document_mix(seed=9, rows=count, seq_len=seq_len, median=seq_len / 4,
                                                    min_len=2)):
        items.append({"input_ids": torch.arange(seq_len) + i, "position_ids": torch.cat([torch.arange(d) for d in docs])})
    return items


def test_loader_replicas_take_disjoint_balanced_micro_batches() -> None:
    items, bs, dp = _packed_items(50, 64), 2, 2
    docs = lognormal_document_mix(seed=9, rows=2, seq_len=64, median=16, min_len=2)
    assert item_work(items[0]) == row_work(docs[0])  # from position_ids
    assert item_work({"input_ids": items[1]["input_ids"], "document_lengths": docs[1]}) == row_work(docs[1])
    assert item_work(torch.arange(64)) == row_work([64])  # plain ids: one document
    loaders = [SequenceParallelLoader(items, ShardSpec(index=0, sp_size=1, dp_rank=d, dp_size=dp), batch_size=bs,
                                      shuffle=True, seed=4, balance_steps=True) for d in range(dp)]
    for loader in loaders:
        loader.set_epoch(1)
    per = [[int(r[0]) for b in loader for r in b["input_ids"]] for loader in loaders]  # row i starts at token i
    assert len(per[0]) == len(per[1]) == len(loaders[0]) * bs == 24  # 12 whole rounds of 4 rows
    assert not set(per[0]) & set(per[1])
    work = [item_work(it) for it in items]
    loads = [[sum(work[i] for i in p[a : a + bs]) for a in range(0, len(p), bs)] for p in per]
    ratios = [max(x, y) / ((x + y) / 2) for x, y in zip(*loads)]
    assert max(ratios) < 1.1, ratios


def test_loader_refuses_what_it_cannot_balance() -> None:
    spec = ShardSpec(index=0, sp_size=1, dp_rank=0, dp_size=2)
    with pytest.raises(ValueError, match="needs a map-style dataset"):
        SequenceParallelLoader(iter([{"input_ids": torch.ones(1, 8)}]), spec, balance_steps=True)
    with pytest.raises(ValueError, match="give drop_last=True"):
        SequenceParallelLoader(_packed_items(4, 16), spec, drop_last=False, balance_steps=True)


def test_bench_steps_end_to_end_at_one_timed_round(tmp_path) -> None:
    """``benchmarks/bench_steps.py`` runs as documented (one timed round) and its JSON line shows the balance."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_steps.py"), "--replicas", "4",
                          "--time-rounds", "1", "--repeats", "1", "--time-seq-len", "2048", "--plot", "none",
                          "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    line = json.loads(res.stdout.strip().splitlines()[-1])
    by = {(r["seq_len"], r["mix"], r["order"]): r for r in line["work"]}
    for n in (8192, 32768, 131072):
        for mix in ("short", "long"):
            assert by[(n, mix, "balanced")]["mean"] <= 1.02 < 1.3 < by[(n, mix, "shuffled")]["mean"]
    assert [r["order"] for r in line["time"]] == ["shuffled", "balanced"]
    assert (tmp_path / "result.json").is_file()
