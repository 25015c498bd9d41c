"""Modules documented as pure import without torch, and the planner's command line runs without it (a laptop
without torch can plan a cluster). Each check runs in a fresh interpreter whose import of torch fails."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.abc, sys

    class _NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is blocked in this test ({name})")
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)

PURE = [
    "ds_wallfacer.comm.layout",
    "ds_wallfacer.comm.dims",
    "ds_wallfacer.data.chunks",
    "ds_wallfacer.data.balance",
    "ds_wallfacer.data.steps",
    "ds_wallfacer.attention.blocks",
    "ds_wallfacer.attention.spans",
    "ds_wallfacer.attention.schedule",
    "ds_wallfacer.attention.fetch",
    "ds_wallfacer.attention.volume",
    "ds_wallfacer.attention.kernel_names",
    "ds_wallfacer.config",
    "ds_wallfacer.mst.config",
    "ds_wallfacer.hf_config",
    "ds_wallfacer.planner",
    "ds_wallfacer.planner.cluster",
    "ds_wallfacer.planner.search",
    "ds_wallfacer.planner.auto",
    "ds_wallfacer.train.options",
]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_the_blocker_blocks() -> None:
    res = _run("import ds_wallfacer.comm.ops")
    assert res.returncode != 0 and "torch is blocked" in res.stderr


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_without_torch(module: str) -> None:
    res = _run(f"import {module}; assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules)")
    assert res.returncode == 0, res.stderr[-2000:]


def test_planner_cli_runs_without_torch() -> None:
    res = _run(
        """
        import runpy
        sys.argv = ["ds_wallfacer.planner", "--cluster", "h100x8", "--model", "llama3-8b", "--seq-len", "65536",
                    "--json", "--plot", "none"]
        try:
            runpy.run_module("ds_wallfacer.planner", run_name="__main__")
        except SystemExit as e:
            assert e.code in (0, None), e.code
        """
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert '"choice"' in res.stdout
