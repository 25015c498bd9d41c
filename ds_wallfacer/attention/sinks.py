"""Attention sinks (gpt-oss): one learned logit per query head that joins every row's softmax normaliser and
carries no value. Applied once, to the merged result of all blocks, ring steps and team members: with (out, lse) a
row's attention over all its keys, lse' = logaddexp(lse, s_h) and out' = out * exp(lse - lse'); the block backward
with (out', lse') is the backward with the sink, and d s_h = -sum over the rows of head h of exp(s_h - lse') *
rowsum(dO * out'), each rank summing over the rows it owns.

Design: Note [Attention sinks] in docs/design/attention.md (why once, why exact, who sums the sink's gradient).
"""
from __future__ import annotations

import torch

__all__ = ["add_sink", "sink_grad", "sink_lse"]


def sink_lse(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """lse' = logaddexp(lse, sink of the row's head): lse [B, h, S] fp32, sinks [h] -> [B, h, S] fp32."""
    return torch.logaddexp(lse, sinks.detach().float().view(1, -1, 1))


def add_sink(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out', lse') of Note [Attention sinks]: out [B, h, S, dv] (any dtype; returned in it), lse [B, h, S] fp32."""
    new = sink_lse(lse, sinks)
    return (out.float() * torch.exp(lse - new).unsqueeze(-1)).to(out.dtype), new


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """d sinks [h] from rows (dO, out', lse') [B, h, S, dv] / [B, h, S]: -sum_rows exp(s - lse') rowsum(dO * out')."""
    delta = (dout.float() * out.float()).sum(-1)  # [B, h, S]
    p_sink = torch.exp(sinks.detach().float().view(1, -1, 1) - lse)
    return -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
