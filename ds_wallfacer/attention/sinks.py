"""Attention sinks (gpt-oss): one learned logit per query head that joins every row's softmax normaliser and
carries no value. Applied once, to the merged result of all blocks, ring steps and team members.

Note [Attention sinks]: with s_h the sink of head h and (out, lse) the attention of a query row over all its keys,
the row with the sink is lse' = logaddexp(lse, s_h) and out' = out * exp(lse - lse') (the sink's column of the
softmax is dropped, so it adds to the normaliser alone). The block backward with (out', lse') in place of
(out, lse) is exactly the backward with the sink: p = exp(score - lse') are the probabilities with the sink, and
delta = rowsum(dO * out') is the full row sum since the sink's value is zero. The sink's own gradient is
d s_h = -sum over rows of head h of exp(s_h - lse') * rowsum(dO * out'). Each rank sums it over the rows it owns
(its tokens; under Ulysses its heads of the gathered sequence), a partial sum like every parameter gradient of a
rank's shard, which DeepSpeed's gradient reduction adds up (docs/design.md §4).
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
