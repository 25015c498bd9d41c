"""Tolerances derived from the operation, not tuned on one CPU.

Two fp32 computations of the same sum in different orders (a varlen call against one call per span, a blocked
kernel against a plain one) differ by rounding alone: each of the n additions rounds by at most one unit of fp32
precision (eps = 2^-23) relative to the running sum, whose size is bounded by the largest partial sum. So
``n * eps * magnitude`` bounds the difference (the worst case of recursive summation, Higham, Accuracy and Stability
of Numerical Algorithms, §4.2), with n the reduction length and ``magnitude`` the size of the largest partial sum:
for the random inputs of these tests, the largest result (or 1, for sums of softmax weights and log-sum-exps).
"""
from __future__ import annotations

import torch

__all__ = ["FP32_EPS", "sum_tolerance"]

FP32_EPS = torch.finfo(torch.float32).eps


def sum_tolerance(terms: int, want: torch.Tensor, *, eps: float = FP32_EPS) -> float:
    """The rounding bound of sums of ``terms`` terms in the precision ``eps``, for results of the size of ``want``."""
    return terms * eps * max(1.0, float(want.abs().max()))
