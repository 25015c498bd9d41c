"""The trainer hides the deprecation notices third-party packages raise from their own code, and only those."""
from __future__ import annotations

import warnings

import pytest

from ds_wallfacer.train.quiet import quiet_third_party_deprecations


@pytest.mark.parametrize("module,shown", [
    ("deepspeed.comm.torch", False), ("transformers.modeling_utils", False), ("torch.distributed", False),
    ("ds_wallfacer.integration.deepspeed", True), ("__main__", True),
])
def test_third_party_deprecations_are_hidden_ours_are_not(module: str, shown: bool, monkeypatch) -> None:
    monkeypatch.delenv("WALLFACER_WARNINGS", raising=False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party_deprecations()
        warnings.warn_explicit("old API", FutureWarning, "x.py", 1, module=module)
        warnings.warn_explicit("something else", UserWarning, "x.py", 2, module=module)
    assert [str(w.message) for w in seen] == (["old API"] if shown else []) + ["something else"]


def test_all_warnings_on_request(monkeypatch) -> None:
    monkeypatch.setenv("WALLFACER_WARNINGS", "all")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_third_party_deprecations()
        warnings.warn_explicit("old API", FutureWarning, "x.py", 1, module="deepspeed.comm.torch")
    assert len(seen) == 1
