"""Checkpoints that fail: the trainer on 2 CPU ranks forked from the test process (``helpers.train_on_ranks``).

One run A (P = 2, ZeRO-2, 5 steps, a checkpoint every step, ``--save_total_limit 2``) of a tiny Llama; then
- A leaves exactly step_4 and step_5, each with a marker that lists every file under it;
- a file rank 1 wrote into step_5 truncated: ``--resume auto`` skips step_5 with one line naming the file, resumes
  from step_4 and step 5's loss equals A's bitwise; the step_5 it writes again verifies;
- ``--resume`` of that truncated step_5 is refused: exit status 2 and one line naming the file;
- a free-space probe that reports 1000 bytes (patched here, inherited by the forked ranks): the first save is
  refused with one line, exit status 2, and no tag is written;
- without processes: the tags ``auto`` tries and in which order, what a file check reports, the size estimates.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ds_wallfacer.train import checkpoint as ckpt
from ds_wallfacer.train import manifest
from tests.train.helpers import losses, p2_trainer_args, summary, train_on_ranks

STEPS = 5
DAMAGED = "zero_pp_rank_1_mp_rank_00_optim_states.pt"  # written by rank 1: rank 0 learns of it from rank 1's verdict


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("ckpt_faults")
    common = [*p2_trainer_args(tmp, steps=STEPS), "--save_every", "1", "--save_total_limit", "2"]
    summary(train_on_ranks(2, tmp / "cwd", "--output_dir", str(tmp / "a"), *common))
    return {"tmp": tmp, "common": common}


def _damaged_copy(run_a: dict, name: str) -> tuple[Path, str]:
    """A's checkpoints in a new output dir, with step_5's ``DAMAGED`` file cut to half its size; the output dir and
    why verification must refuse it."""
    out = run_a["tmp"] / name
    shutil.copytree(run_a["tmp"] / "a" / "checkpoints", out / "checkpoints")
    path = out / "checkpoints" / "step_5" / DAMAGED
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return out, f"step_5: {DAMAGED} is {len(data) // 2} bytes, the marker says {len(data)}"


def _lines(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def _verifies(tag_dir: Path) -> bool:
    files = json.loads((tag_dir / ckpt.MARKER).read_text())["files"]
    return manifest.problem(tag_dir, files) is None


def test_save_total_limit_keeps_the_newest_complete_tags(run_a: dict) -> None:
    root = run_a["tmp"] / "a" / "checkpoints"
    assert sorted(d.name for d in root.iterdir() if d.is_dir()) == ["step_4", "step_5"]
    assert (root / "latest").read_text() == "step_5"
    for tag in ("step_4", "step_5"):
        listed = {e["path"] for e in json.loads((root / tag / ckpt.MARKER).read_text())["files"]}
        on_disk = {p.name for p in (root / tag).iterdir() if p.name != ckpt.MARKER}
        assert listed == on_disk and DAMAGED in listed, (listed, on_disk)
        assert _verifies(root / tag)


def test_resume_auto_skips_a_damaged_tag(run_a: dict) -> None:
    out, why = _damaged_copy(run_a, "auto")
    res = train_on_ranks(2, run_a["tmp"] / "cwd", "--output_dir", str(out), "--resume", "auto", *run_a["common"])
    s = summary(res)
    assert _lines(res.stdout, "ds_wallfacer.train: skipped") == [f"ds_wallfacer.train: skipped checkpoint {why}"]
    assert s["resumed_from"].endswith("step_4") and s["steps_this_run"] == 1, s
    got = losses(out)
    assert list(got) == [5] and got[5] == losses(run_a["tmp"] / "a")[5]  # bitwise
    assert _verifies(out / "checkpoints" / "step_5")  # written again


def test_resume_of_a_damaged_tag_is_refused(run_a: dict) -> None:
    out, why = _damaged_copy(run_a, "explicit")
    tag = str(out / "checkpoints" / "step_5")
    res = train_on_ranks(2, run_a["tmp"] / "cwd", "--output_dir", str(out), "--resume", tag, *run_a["common"])
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert _lines(res.stderr, "ds_wallfacer.train") == [
        f"ds_wallfacer.train: error: --resume {tag!r} fails verification: {why}"]
    assert "Traceback" not in res.stdout + res.stderr


def test_save_without_room_is_refused_before_writing(run_a: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(manifest, "free_bytes", lambda path: 1000)  # the forked ranks inherit it
    out = run_a["tmp"] / "full"
    res = train_on_ranks(2, run_a["tmp"] / "cwd", "--output_dir", str(out), *run_a["common"])
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    lines = _lines(res.stderr, "ds_wallfacer.train")
    assert len(lines) == 1 and lines[0].startswith(
        f"ds_wallfacer.train: error: no room for checkpoint step_1 in {out / 'checkpoints'} (rank 0, "), lines
    assert "parameters x 16 bytes), 1000 B free" in lines[0], lines
    assert "Traceback" not in res.stdout + res.stderr
    assert not (out / "checkpoints").exists()  # nothing written, not even the folder
    assert [line.split()[:2] for line in _lines(res.stdout, "step ")] == [["step", "1"]]  # stopped at the save


def test_candidates_file_checks_and_estimates(tmp_path: Path) -> None:
    """The pure parts, without processes: which tags ``auto`` tries in which order, what a check reports."""
    root = tmp_path / "out" / "checkpoints"
    for step in (2, 4, 6):
        tag = root / f"step_{step}"
        tag.mkdir(parents=True)
        (tag / "a.pt").write_bytes(bytes(range(256)) * step)
        files = [manifest.entry(tag, tag / "a.pt", rank=1)]
        (tag / ckpt.MARKER).write_text(json.dumps({"step": step, "world_size": 2, "files": files}))
    (root / "step_8").mkdir()  # interrupted: never a candidate
    (root / "latest").write_text("step_4")
    assert ckpt.resume_candidates("auto", tmp_path / "out") == [root / "step_4", root / "step_2"]
    (root / "latest").unlink()
    assert ckpt.resume_candidates("auto", tmp_path / "out") == [root / f"step_{k}" for k in (6, 4, 2)]
    assert ckpt.resume_candidates(str(root / "step_2"), tmp_path) == [root / "step_2"]
    assert ckpt.resolve_resume("auto", tmp_path / "out") == root / "step_6"

    tag = root / "step_6"
    files = json.loads((tag / ckpt.MARKER).read_text())["files"]
    assert manifest.problem(tag, files) is None
    data = bytearray((tag / "a.pt").read_bytes())
    data[700] ^= 1  # same size, one bit flipped
    (tag / "a.pt").write_bytes(bytes(data))
    assert manifest.problem(tag, files) == (f"a.pt has CRC32 {manifest.crc32(tag / 'a.pt'):08x}, the marker says "
                                            f"{files[0]['crc32']}")
    (tag / "a.pt").unlink()
    assert manifest.problem(tag, files) == "a.pt is missing (written by rank 1)"

    assert manifest.estimate_bytes(root / "step_4", params=10, param_bytes=2) == (
        1024 + (root / "step_4" / ckpt.MARKER).stat().st_size, "the size of step_4")
    assert manifest.estimate_bytes(None, params=10, param_bytes=2) == (140, "10 parameters x 14 bytes")
    assert [manifest.format_bytes(n) for n in (1000, 1536, 3 << 30)] == ["1000 B", "1.5 KiB", "3.0 GiB"]
