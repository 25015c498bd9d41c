"""TRL's fused LM head under sequence parallelism: ``model(input_ids=..., attention_mask=..., labels=...,
fused_lm_head=True)`` on a full batch, computed on this rank's shard and returned full.

TRL's preference and RL trainers (DPO, GRPO, ...) patch the policy (and reference) model with
``trl.trainer.utils.add_fused_lm_head``: with ``fused_lm_head=True`` the forward runs the backbone and scores, in
tiles, each position's next-token label, returning per-token ``log_probs`` (and ``entropy``, ``mean_logits``, ...)
of shape [B, N - 1] instead of the [B, N, V] logits. Every loss those trainers compute is then a function of these
per-token values and the batch's masks.

``shard_fused_lm_head`` wraps that forward once more. A call with ``fused_lm_head=True`` gets the full batch (every
rank of the sequence-parallel group holds the same one), and

1. packs the rows into one row of documents, without padding (Note [Rows as documents]), with the labels shifted
   before sharding (as the loader shifts them, ``data/loader.py``: no label crosses a shard),
2. shards it like the loader does (``data.loader.prepare_batch``) and runs TRL's own fused forward on the shard,
   with pre-shifted ``shift_labels``: the backbone under sequence-parallel attention (each document attends only
   to itself), the LM head in tiles on the shard only, so neither the full hidden states nor any [N, V] logits
   exist on a rank,
3. all-gathers the per-token values over the group (one number per token each: a few MB at 1M tokens) and puts
   them back in the caller's [B, N - 1] layout.

The trainer's loss then runs unchanged on the full per-token tensors, identically on every rank of the group.
Note [Gradient of the gathered log-probabilities]: the backward of the gather is a reduce-scatter, so each rank's
shard receives the gradient summed over the group's identical losses, P times its part of the one loss; DeepSpeed's
average over all W = P x D ranks divides the P out, as for the token-mean loss (docs/design/layouts.md).

Each document's positions start at 0. Models with learned absolute position embeddings would score a left-padded
row at other positions than their own forward does: refused at construction
(``fused_trainer.refuse_absolute_positions``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CommLayer
from ..data.loader import prepare_batch
from ..data.pieces import unshard_sequence
from ..integration.parallel import check_same_batch

__all__ = ["GatherShards", "aligned_rows", "pack_rows", "per_token_fields", "shard_fused_lm_head"]

_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")
"""TRL's ``FusedCausalLMOutput`` per-token fields, [B, N - 1] each."""
_IGNORED = frozenset({"use_cache", "return_dict", "output_router_logits"})
"""Keywords TRL passes that do not change the per-token values (``output_router_logits`` must be off: MoE aux
losses are refused by the Trainer path)."""


class GatherShards(torch.autograd.Function):
    """[*s] on each rank of ``group`` -> [n, *s] in group-rank order; backward: reduce-scatter (Note [Gradient of
    the gathered log-probabilities])."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommLayer, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        with comm.phase("loss"):
            return comm.all_gather(x, group)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        with ctx.comm.phase("loss"):
            return ctx.comm.reduce_scatter(g.contiguous(), ctx.group), None, None


def aligned_rows(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(leading padding, real length) per row of a [B, N] mask whose ones are one contiguous run per row (left
    and/or right padding); anything else (holes, packed rows given as a mask) is refused."""
    mask = attention_mask.bool()
    n = mask.shape[1]
    lengths = mask.sum(dim=1)
    lead = torch.where(lengths > 0, mask.int().argmax(dim=1), torch.zeros_like(lengths))
    pos = torch.arange(n, device=mask.device)
    run = (pos >= lead[:, None]) & (pos < (lead + lengths)[:, None])
    if not torch.equal(run, mask):
        raise ValueError("fused LM head under sequence parallelism: attention_mask has a hole inside a row; only left "
                         "and right padding around one run of tokens per row are supported")
    return lead, lengths


def pack_rows(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor, *,
              ignore_index: int = -100) -> tuple[dict[str, Any], torch.Tensor]:
    """A [B, N] batch (each row one run of tokens between left and right padding) -> one row holding every row's
    tokens as a document of its own (``document_lengths``), with its shifted labels (a document's last token has
    none), and, per packed token, its flat position ``row * N + t`` in the caller's layout.

    Note [Rows as documents]. A packed row has no padding, so the sequence-parallel work is that of the real
    tokens (GRPO's prompts are left-padded, completions end at different lengths; DPO pads chosen and rejected to
    the longer). Each document's positions start at 0, as the model's own forward places a right-padded row; a
    left-padded row (real tokens from position ``lead``) keeps every relative position, so rotary attention is
    the model's (up to float rounding of the angles)."""
    aligned_rows(attention_mask)  # one run per row, or refused
    b, n = input_ids.shape
    keep = attention_mask.bool()
    rows, cols = keep.nonzero(as_tuple=True)  # row-major: each row's tokens in order
    if rows.numel() == 0:
        raise ValueError("fused LM head under sequence parallelism: the batch has no tokens")
    nxt = (cols + 1).clamp(max=n - 1)
    has_next = (cols + 1 < n) & keep[rows, nxt]
    targets = torch.where(has_next, labels[rows, nxt], torch.full_like(cols, ignore_index))
    docs = [int(k) for k in keep.sum(dim=1).tolist() if k > 0]
    full = {"input_ids": input_ids[rows, cols][None].cpu(), "shift_labels": targets[None].cpu(),
            "document_lengths": [docs]}
    return full, rows * n + cols


def per_token_fields(out: Any) -> dict[str, torch.Tensor]:
    """The per-token fields TRL's fused forward computed (the others are None)."""
    return {name: getattr(out, name) for name in _FIELDS if getattr(out, name, None) is not None}


class _ShardedHead:
    """The wrapper ``shard_fused_lm_head`` installs; ``inner`` is TRL's fused forward (bound to the model)."""

    def __init__(self, inner: Callable[..., Any], sp: Any) -> None:
        self.inner, self.sp = inner, sp

    def __call__(self, *args: Any, fused_lm_head: bool = False, **kwargs: Any) -> Any:
        if not fused_lm_head:  # generation, the self-check, a user's own call: the model's forward as TRL left it
            return self.inner(*args, **kwargs)
        if args:
            raise ValueError("fused LM head under sequence parallelism: pass input_ids, attention_mask and labels by "
                             "keyword")
        return self.sharded(**kwargs)

    def sharded(self, *, input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
                shift_labels: torch.Tensor | None = None, num_items_in_batch: Any = None, **kwargs: Any) -> Any:
        from trl.trainer.utils import FusedCausalLMOutput

        unknown = sorted(k for k, v in kwargs.items() if k not in _IGNORED and v is not None)
        if unknown or shift_labels is not None or kwargs.get("output_router_logits"):
            raise ValueError(
                f"fused LM head under sequence parallelism: {unknown or ['shift_labels / output_router_logits']} not "
                "supported (text-only batches of input_ids, attention_mask and labels; no MoE aux loss)"
            )
        sp = self.sp
        check_same_batch({"input_ids": input_ids}, group=sp.groups.sp_group, comm=sp.comm)
        ignore = sp.ignore_index
        b, n = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        full, flat = pack_rows(input_ids, labels, attention_mask, ignore_index=ignore)
        spec = sp.groups.shard_spec
        shard = prepare_batch(full, spec, pad_token_id=sp.pad_token_id, ignore_index=ignore)
        device = input_ids.device
        assignment = shard.get("chunk_assignment")
        model_kwargs = sp.module.attention_kwargs(shard["position_ids"].to(device),
                                                  shard["document_starts"].to(device),
                                                  None if assignment is None else assignment.to(device))
        out = self.inner(input_ids=shard["input_ids"].to(device), position_ids=shard["position_ids"].to(device),
                         shift_labels=shard["shift_labels"].to(device), fused_lm_head=True, use_cache=False,
                         **model_kwargs)
        local = per_token_fields(out)
        unshard = dict(dim=1, ulysses_degree=spec.ulysses_degree,
                       scheme="zigzag" if assignment is None else spec.scheme,
                       assignment=None if assignment is None else assignment.tolist())
        flat = flat.to(device)
        dims = sp.setup.dims
        ranks = dims.sp_ranks(sp.groups.dp_index)  # group order; the gathered shards are taken by shard index
        group_order = sorted(range(len(ranks)), key=lambda g: dims.shard_index(ranks[g]))

        def restore(gathered: torch.Tensor) -> torch.Tensor:
            """[P, 1, T_padded / P] shards -> [B, N - 1] in the caller's positions (position t scores token t + 1;
            zero where nothing is scored)."""
            shards = [gathered[g] for g in group_order]  # by shard index
            whole = unshard_sequence(shards, **unshard)[0, : flat.numel()]
            return whole.new_zeros(b * n).index_add(0, flat, whole).view(b, n)[:, :-1]

        comm, group = sp.comm, sp.groups.sp_group
        fields = {"log_probs": restore(GatherShards.apply(local.pop("log_probs").float(), comm, group))}
        if local:  # detached values (metrics, masks): one gather for all of them
            names = list(local)
            with comm.phase("loss"):
                stacked = comm.all_gather(torch.stack([local[k].detach().float() for k in names]), group)
            for i, name in enumerate(names):
                value = restore(stacked[:, i])
                fields[name] = value.bool() if local[name].dtype == torch.bool else value.to(local[name].dtype)
        fields["log_probs"] = fields["log_probs"].to(out.log_probs.dtype)
        mask = fields.get("label_mask")
        count = (mask.sum() if mask is not None else (labels[:, 1:] != ignore).sum()).clamp(min=1)
        loss = -fields["log_probs"].sum() / (count if num_items_in_batch is None else num_items_in_batch)
        return FusedCausalLMOutput(loss=loss, **fields)


def shard_fused_lm_head(model: nn.Module, sp: Any) -> None:
    """Wrap TRL's fused forward of ``model`` (the HF model, under PEFT its base model) so that ``fused_lm_head=True``
    calls run sequence-parallel over ``sp`` (an ``integration.SequenceParallel``). Idempotent."""
    current = model.__dict__.get("forward")
    if isinstance(getattr(current, "__self__", None), _ShardedHead):
        return
    func = getattr(current, "__func__", None)
    if func is None or "fused_lm_head" not in func.__code__.co_varnames:
        raise ValueError(f"{type(model).__name__} has no fused LM head: TRL's trainer adds it "
                         "(trl.trainer.utils.add_fused_lm_head) before the sequence-parallel setup")
    model.forward = _ShardedHead(current, sp).__call__  # an instance attribute, as TRL's own patch
