"""The global token-mean causal-LM loss across sequence-parallel ranks (issue 4).

Each rank computes (loss_sum, token_count) over its shard's non-ignored ``shift_labels``; both are summed over
the sequence-parallel group and divided: the same number a non-parallel run prints, on every rank.

Gradient normalisation (DESIGN.md section 5): DeepSpeed is handed no sequence-parallel mpu, so for every ZeRO
stage it treats all W = D * P ranks as data-parallel replicas and averages gradients over W. The sum over ranks
is differentiable with an all-reduce backward, so every rank back-propagates P times its share of dL/dtheta;
DeepSpeed's 1/W then leaves the sum over the P ranks of a group, averaged over the D replicas: exactly the
non-parallel gradient (mean over replicas, like plain data parallelism).

The local loss is pluggable (``LocalLoss``): full logits from the model, or the Mini-Sequence LM head
(``ds_wallfacer.mst.mini_sequence_causal_lm_loss``) that never materialises [S, V] logits.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import CommLayer

__all__ = ["LocalLoss", "SequenceParallelCausalLM", "global_token_mean", "logits_loss", "mini_sequence_loss"]

LocalLoss = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(lm, *, input_ids, position_ids, shift_labels, ignore_index) -> (loss_sum fp32, token_count)``."""


class _SumOverRanks(torch.autograd.Function):
    """[k] on each rank -> [k] summed over ``group``, in rank order (bitwise equal on every rank); backward: the
    gradients summed likewise (the adjoint of a replicated sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommLayer, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        with comm.phase("loss"):
            return comm.all_gather(x, group).sum(0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        with ctx.comm.phase("loss"):
            return ctx.comm.all_gather(g.contiguous(), ctx.group).sum(0), None, None


def global_token_mean(
    loss_sum: torch.Tensor, count: torch.Tensor, *, group: dist.ProcessGroup, comm: CommLayer
) -> torch.Tensor:
    """Sum of token losses over the group / number of non-ignored tokens over the group (0 when there are none)."""
    # one fp64 all-gather for both: token counts stay exact far beyond fp32's 2^24
    both = torch.stack([loss_sum.double(), count.detach().to(device=loss_sum.device, dtype=torch.float64)])
    total = _SumOverRanks.apply(both, comm, group)
    return (total[0] / total[1].clamp(min=1)).float()


def logits_loss(
    lm: nn.Module, *, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) from the model's own logits (fp32 cross-entropy, like HF's loss)."""
    logits = lm(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits  # [B, S_l, V]
    labels = shift_labels.reshape(-1).to(logits.device)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels, ignore_index=ignore_index, reduction="sum"
    )
    return loss_sum, (labels != ignore_index).sum()


def mini_sequence_loss(
    lm: nn.Module, *, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) with the Mini-Sequence LM head: the backbone's hidden states, then chunked head + CE."""
    from ..mst import mini_sequence_causal_lm_loss

    out = lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return mini_sequence_causal_lm_loss(lm, hidden, shift_labels.to(hidden.device), ignore_index=ignore_index)


class SequenceParallelCausalLM(nn.Module):
    """What ``deepspeed.initialize`` receives: the HF causal LM (``.lm``, unchanged) and the global token-mean
    loss. ``forward(input_ids, position_ids, shift_labels)`` takes a batch from the sequence-parallel loader."""

    def __init__(
        self,
        lm: nn.Module,
        *,
        group: dist.ProcessGroup,
        comm: CommLayer,
        local_loss: LocalLoss = logits_loss,
        ignore_index: int = -100,
    ) -> None:
        super().__init__()
        self.lm = lm
        self._group, self._comm, self._local_loss, self.ignore_index = group, comm, local_loss, ignore_index

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor
    ) -> torch.Tensor:
        loss_sum, count = self._local_loss(
            self.lm, input_ids=input_ids, position_ids=position_ids, shift_labels=shift_labels,
            ignore_index=self.ignore_index,
        )
        return global_token_mean(loss_sum, count, group=self._group, comm=self._comm)
