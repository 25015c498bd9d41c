"""A real install works without the repository: the wheel built from the sources, installed into a folder of its
own, trains two steps with every default (the example ds_config, the demo corpus, the output dir) from a folder
outside the checkout, through ``deepspeed --module ds_wallfacer.train`` on one CPU rank.

The installed package reuses this environment's dependencies (torch, DeepSpeed, transformers), so nothing is
downloaded; only ``ds_wallfacer`` comes from the wheel, and the test checks that it does.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist_utils import free_port
from tests.train.helpers import DEEPSPEED, ROOT, env

pytestmark = [
    pytest.mark.skipif(DEEPSPEED is None, reason="the deepspeed launcher is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="setuptools is needed to build"),
]

BUILD_INPUTS = ("setup.py", "setup.cfg", "pyproject.toml", "MANIFEST.in", "README.md", "ds_wallfacer")
"""What the build reads; copied so that building leaves nothing (build/, *.egg-info) in the checkout."""


def _pip(*args: str, cwd: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "pip", *args, "--no-deps", "--no-index", "-q"], cwd=cwd, env=env(),
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


def _wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        elif (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    _pip("wheel", "--no-build-isolation", "--wheel-dir", str(tmp / "dist"), str(src), cwd=tmp)
    (wheel,) = (tmp / "dist").glob("ds_wallfacer-*.whl")
    return wheel


def test_the_installed_wheel_trains_with_its_defaults_from_any_folder(tmp_path: Path) -> None:
    site = tmp_path / "site"
    _pip("install", "--target", str(site), str(_wheel(tmp_path)), cwd=tmp_path)
    shipped = site / "ds_wallfacer" / "examples"
    assert (shipped / "configs" / "wallfacer.json").is_file() and (shipped / "data" / "sample.txt").is_file(), \
        "the wheel lacks the example configs or the demo corpus"
    pngs = list((shipped / "vlm_chat" / "images").glob("*.png"))
    assert (shipped / "vlm_chat" / "chat.jsonl").is_file() and len(pngs) == 12, "the wheel lacks the image example"
    work = tmp_path / "elsewhere"
    work.mkdir()
    run_env = {**env(), "PYTHONPATH": str(site)}  # the installed package only: not the checkout
    probe = "import ds_wallfacer.train.cli as c; print(c.__file__, c.DEFAULT_CONFIG, c.DEFAULT_DATA)"
    where = subprocess.run([sys.executable, "-c", probe], cwd=work, env=run_env, capture_output=True, text=True,
                           timeout=120)
    assert where.returncode == 0, where.stderr
    for path in where.stdout.split():
        assert Path(path).resolve().is_relative_to(site.resolve()), f"{path} is not from the installed wheel in {site}"
    cmd = [DEEPSPEED, "--num_gpus", "1", "--master_port", str(free_port()), "--module", "ds_wallfacer.train",
           "--steps", "2", "--seq_len", "64", "--no_wandb", "--no_progress"]
    res = subprocess.run(cmd, cwd=work, env=run_env, capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    summary = json.loads([line for line in res.stdout.splitlines() if line.startswith("{")][-1])
    assert summary["steps"] == 2 and summary["finite"], summary
    assert (work / summary["checkpoint"]).resolve() == (work / "runs" / "checkpoints" / "step_2").resolve(), summary
    assert (work / "runs" / "hf_model" / "config.json").is_file()  # the default --output_dir, under the folder
