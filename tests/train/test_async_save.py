"""Asynchronous saves (``--async_save``): the trainer on 2 CPU ranks forked from the test process
(``helpers.train_on_ranks``), P = 2, ZeRO-2, a tiny Llama, a checkpoint every 2 of 4 steps.

- S (synchronous) and B (``--async_save``) train the same losses bitwise; B's tags verify against their markers
  and hold the same files as S's; in B every marker appeared only when ``finalize`` ran, after the writers were
  done (``finalize`` wrapped here, inherited by the forked ranks: it notes what it saw in a file);
- B's step_2 resumed with ``--resume auto`` (step_4 left without its marker, as an interrupted save leaves it)
  continues with S's losses bitwise;
- a writer that fails on rank 1 (its write patched to raise) ends the run on every rank with one line naming the
  rank and the file, exit status 2, and the tag stays unmarked, so ``--resume auto`` finds nothing;
- without processes: the host copy a save takes is independent of the live tensors.
"""
from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import pytest
import torch

from ds_wallfacer.train import async_save, manifest
from ds_wallfacer.train import checkpoint as ckpt
from tests.train.helpers import losses, p2_trainer_args, summary, train_on_ranks

STEPS = 4
FAILING = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # written by rank 1


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("async_save")
    common = [*p2_trainer_args(tmp, steps=STEPS), "--save_every", "2"]
    summary(train_on_ranks(2, tmp / "cwd", "--output_dir", str(tmp / "s"), *common))
    return {"tmp": tmp, "common": common}


@pytest.fixture(scope="module")
def run_b(setup: dict) -> dict:
    """B: ``--async_save``, with ``PendingSave.finalize`` noting (in ``finalize.jsonl``) whether the tag's marker
    existed once this rank's writer was done and before the marker was written, whether it verified after, and what
    a second ``finalize`` and a ``poll`` after it raised."""
    out = setup["tmp"] / "b"
    original = ckpt.PendingSave.finalize

    def observed(self: ckpt.PendingSave) -> Path:
        self._writer.join()
        before = (self.tag_dir / ckpt.MARKER).exists()
        tag = original(self)
        files = json.loads((tag / ckpt.MARKER).read_text())["files"]
        refused = []
        for again in (lambda: original(self), lambda: self.poll(None, device=torch.device("cpu"))):
            try:
                again()
            except RuntimeError as e:
                refused.append(str(e))
        with open(out / "finalize.jsonl", "a") as f:
            f.write(json.dumps({"tag": tag.name, "marker_before": before, "writer_done": self._writer.done(),
                                "verifies": manifest.problem(tag, files) is None, "refused": refused}) + "\n")
        return tag

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ckpt.PendingSave, "finalize", observed)
        s = summary(train_on_ranks(2, setup["tmp"] / "cwd", "--output_dir", str(out), "--async_save",
                                   *setup["common"]))
    return {"out": out, "summary": s}


def test_async_save_trains_alike_and_marks_only_at_finalize(setup: dict, run_b: dict) -> None:
    s_dir, b_dir = setup["tmp"] / "s", run_b["out"]
    assert losses(b_dir) == losses(s_dir) and sorted(losses(b_dir)) == [1, 2, 3, 4]  # bitwise
    seen = [json.loads(line) for line in (b_dir / "finalize.jsonl").read_text().splitlines()]
    assert collections.Counter(row["tag"] for row in seen) == {"step_2": 2, "step_4": 2}  # every rank, every tag
    assert all(not row["marker_before"] and row["writer_done"] and row["verifies"] for row in seen), seen
    assert seen[0]["refused"] == ["PendingSave.finalize of step_2 called twice",
                                  "PendingSave.poll of step_2 after finalize"]  # misuse refused, not repeated
    assert (b_dir / "checkpoints" / "latest").read_text() == "step_4"
    assert run_b["summary"]["checkpoint"].endswith("step_4")
    for tag in ("step_2", "step_4"):
        marker = json.loads((b_dir / "checkpoints" / tag / ckpt.MARKER).read_text())
        sync = json.loads((s_dir / "checkpoints" / tag / ckpt.MARKER).read_text())
        assert sorted((e["path"], e["rank"]) for e in marker["files"]) == sorted(
            (e["path"], e["rank"]) for e in sync["files"])
        assert not [p for p in (b_dir / "checkpoints" / tag).iterdir() if p.name.startswith(".")]  # no temporaries


def test_async_save_resumes_bitwise(setup: dict, run_b: dict) -> None:
    out = setup["tmp"] / "b_resumed"
    shutil.copytree(run_b["out"] / "checkpoints", out / "checkpoints")
    (out / "checkpoints" / "step_4" / ckpt.MARKER).unlink()  # its writers were interrupted: never finalized
    res = train_on_ranks(2, setup["tmp"] / "cwd", "--output_dir", str(out), "--resume", "auto", "--async_save",
                         *setup["common"])
    s = summary(res)
    assert s["resumed_from"].endswith("step_2") and s["steps_this_run"] == 2, s
    want, got = losses(setup["tmp"] / "s"), losses(out)
    assert sorted(got) == [3, 4] and all(got[k] == want[k] for k in got)  # bitwise
    files = json.loads((out / "checkpoints" / "step_4" / ckpt.MARKER).read_text())["files"]
    assert manifest.problem(out / "checkpoints" / "step_4", files) is None  # written again, verified


def test_a_failing_writer_stops_every_rank_and_leaves_the_tag_unmarked(setup: dict,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    original = async_save.BackgroundWriter.write_durable

    def failing(self: async_save.BackgroundWriter, snapshot: object, path: Path) -> None:
        if path.name == FAILING:
            raise OSError(28, "No space left on device")
        original(self, snapshot, path)

    monkeypatch.setattr(async_save.BackgroundWriter, "write_durable", failing)  # the forked ranks inherit it
    out = setup["tmp"] / "failing"
    res = train_on_ranks(2, setup["tmp"] / "cwd", "--output_dir", str(out), "--async_save", *setup["common"])
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [line for line in res.stderr.splitlines() if line.startswith("ds_wallfacer.train")]
    tag = out / "checkpoints" / "step_2"
    assert lines == [
        f"ds_wallfacer.train: error: checkpoint step_2 was not written: rank 1 could not write {tag / FAILING}: "
        "OSError: [Errno 28] No space left on device; the tag stays unmarked (--resume auto skips it): free space "
        "or fix the folder's permissions, then --resume auto"], res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    assert not (tag / ckpt.MARKER).exists() and not (out / "checkpoints" / "latest").exists()
    assert ckpt.resume_candidates("auto", out) == []
    assert not (out / "checkpoints" / "step_4").exists()  # stopped before the next save


def test_host_copy_is_independent_of_the_live_tensors() -> None:
    """What a save snapshots: tensors copied (once each), containers rebuilt with their types, other values kept."""
    Pair = collections.namedtuple("Pair", "a b")
    live = torch.arange(6, dtype=torch.float32)
    state = collections.OrderedDict(w=live, again=[live, live[:2]], pair=Pair(live, 3), text="x")
    snap = async_save.host_copy(state, {})
    live.add_(100)  # the optimizer's next step, in place
    assert type(snap) is collections.OrderedDict and type(snap["pair"]) is Pair and snap["text"] == "x"
    torch.testing.assert_close(snap["w"], torch.arange(6, dtype=torch.float32), rtol=0, atol=0)
    assert snap["again"][0] is snap["w"] and snap["pair"].a is snap["w"]  # one copy of one tensor
    torch.testing.assert_close(snap["again"][1], torch.arange(2, dtype=torch.float32), rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_copy_of_gpu_tensors_is_pinned_and_complete() -> None:
    """A GPU tensor's snapshot lands in pinned host memory (an asynchronous copy: ``BackgroundWriter.start``
    synchronizes before the thread reads it)."""
    live = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    snap = async_save.host_copy({"w": live}, {})
    torch.cuda.synchronize()
    live.add_(1)
    assert snap["w"].device.type == "cpu" and snap["w"].is_pinned()
    torch.testing.assert_close(snap["w"], torch.arange(1 << 20, dtype=torch.float32), rtol=0, atol=0)
