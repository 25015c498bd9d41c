"""Inputs and the comparison of the log-sum-exp merge tests (test_merge.py), in a module of their own: the test that
runs the Triton kernel under Triton's CPU interpreter does so in a subprocess, which imports them from here."""
from __future__ import annotations

import torch

__all__ = ["INF", "assert_same_merge", "merge_case"]

INF = float("-inf")


def merge_case(seed: int = 0, out_dtype: torch.dtype = torch.float32,
               device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A team-wide accumulator (the merge writes a strided slice of it) and one block, with rows that have seen
    nothing yet (acc lse -inf), block rows that see nothing (lse -inf, out 0), and rows with both."""
    g = torch.Generator().manual_seed(seed)
    b, h, s, d = 2, 3, 40, 72
    acc = torch.randn(b, h, s + 24, d, generator=g, dtype=torch.float64)
    acc_lse = torch.randn(b, h, s + 24, generator=g, dtype=torch.float64) * 4
    out = torch.randn(b, h, s, d, generator=g, dtype=torch.float64)
    lse = torch.randn(b, h, s, generator=g, dtype=torch.float64) * 4
    acc[0, 1, 8:16], acc_lse[0, 1, 8:16] = 0.0, INF  # slice rows 0..7: nothing seen yet
    out[0, 1, 4:10], lse[0, 1, 4:10] = 0.0, INF  # block rows 4..9 see nothing (4..7: neither)
    lse[1, 2, 7] = 80.0  # one dominant block row
    to = lambda x, dt: x.to(device=device, dtype=dt)  # noqa: E731
    return to(acc, torch.float32), to(acc_lse, torch.float32), to(out, out_dtype), to(lse, torch.float32)


def assert_same_merge(a: torch.Tensor, b: torch.Tensor, la: torch.Tensor, lb: torch.Tensor, tol: float) -> None:
    """Outputs within ``tol``; log-sum-exps -inf at the same rows and within ``tol`` elsewhere."""
    torch.testing.assert_close(a.double(), b.double(), atol=tol, rtol=tol)
    assert torch.equal(torch.isinf(la), torch.isinf(lb))
    fin = torch.isfinite(lb)
    torch.testing.assert_close(la[fin].double(), lb[fin].double(), atol=tol, rtol=tol)
