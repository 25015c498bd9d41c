"""The multimodal sweep as part of the sweep target (``bash launch/sweep.sh``; skipped in the main suite): every
image-text-to-text class given a batch with images is exact on 4 ranks or refused by the loader with a message
naming the class; the classes ds_wallfacer adapts must be exact."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("WALLFACER_SWEEP") != "1",
                                reason="the sweep is its own target: bash launch/sweep.sh")


def test_every_vision_language_class_with_images_is_exact_or_refused(tmp_path: Path) -> None:
    from ds_wallfacer.adapters.vision import ADAPTED
    from tests.sweep.multimodal import run, table_lines
    from tests.sweep.run import PASSING

    rows = run()
    table = Path(os.environ.get("WALLFACER_SWEEP_TABLE") or tmp_path / "models.md")
    if table.exists():  # after the causal-LM table (test_models.py runs first): its multimodal section replaced
        text = table.read_text().split("\n## With images\n")[0].rstrip("\n")
        table.write_text(text + "\n" + "\n".join(table_lines(rows)) + "\n")
    bad = [f"{r.cls}: {r.verdict}: {r.detail}" for r in rows if r.verdict not in PASSING]
    assert not bad, "\n".join(bad)
    verdict = {r.cls: r.verdict for r in rows}
    assert {c: verdict.get(c) for c in ADAPTED} == {c: "exact" for c in ADAPTED}, verdict
