"""The benchmarks' packed-document data: seeded batches of log-normal document lengths (the long-tail mixes of
``bench_balance.py``, ``bench_packed.py`` and ``bench_steps.py``, and of the tests that measure balance on them)."""
from __future__ import annotations

import math
import random

__all__ = ["lognormal_document_mix"]


def lognormal_document_mix(
    *,
    seed: int,
    rows: int,
    seq_len: int,
    median: float = 2048.0,
    sigma: float = 1.5,
    min_len: int = 100,
    max_len: int = 65536,
) -> list[list[int]]:
    """A seeded packed batch for balance measurements: document lengths log-normal (``median``, ``sigma``),
    clipped to [``min_len``, ``max_len``], packed in order into rows of ``seq_len`` tokens; the document that
    does not fit is cut at the row end (what packing with truncation does)."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        row: list[int] = []
        left = seq_len
        while left:
            length = min(max(int(rng.lognormvariate(math.log(median), sigma)), min_len), max_len, left)
            row.append(length)
            left -= length
        out.append(row)
    return out
