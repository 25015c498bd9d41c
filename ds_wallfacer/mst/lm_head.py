"""Mini-sequence LM head + cross-entropy (MsT).

Per mini-sequence of ``chunk_tokens`` tokens: fp32 logits (then the model's own scaling, ``HeadTransform``), the
cross-entropy SUM and its gradients, after which the logits are dropped: full [T, V] logits never exist and the
logits are computed once per step. ``mini_sequence_causal_lm_loss`` gives (loss_sum, token_count) over labels that
are ALREADY SHIFTED (sequence-parallel ranks sum both before dividing); ``mini_sequence_lm_loss`` a single process's
token mean.

Design: docs/design/memory.md (LM head + cross-entropy), Note [Lean LM head] below.
"""
from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..hf_config import text_config
from .config import DEFAULT_LOGITS_BUDGET_MIB, auto_lm_head_chunk_tokens
from .mlp import even_chunk_tokens

__all__ = [
    "HeadTransform",
    "chunked_linear_cross_entropy",
    "head_transform",
    "mini_sequence_causal_lm_loss",
    "mini_sequence_lm_loss",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)
_MST_ATTR = "_wallfacer_mst_lm_head_chunk_tokens"
_SLICE_BYTES = 64 << 20


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """(sum of CE(t(x @ W^T + b)), count) over mini-sequences, t the model's ``HeadTransform``; gradients formed in
    forward, returned in backward.

    Memory (Note [Lean LM head]): one [c, V] fp32 buffer per mini-sequence (``_logits_grad_``: the logits become
    their own gradient in place), plus the dx [T, d] and dW [V, d] accumulators that carry the gradients from
    forward to backward; backward scales those in place and hands them to autograd, so no second [V, d] copy is
    ever made. The accumulators are consumed by the one backward a forward has: a second backward through the
    same graph (``retain_graph=True``) raises.
    """

    @staticmethod
    def forward(ctx, x, labels, weight, bias, chunk_tokens: int, ignore_index: int, transform: "HeadTransform"):
        need_x, _, need_w, need_b = ctx.needs_input_grad[:4]
        need_any = need_x or need_w or need_b
        n = x.shape[0]  # x: [T, d], labels: [T]
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if need_x else None
        # 16-bit head gradients are summed over mini-sequences in fp32 (one rounding, like one big matmul)
        acc_dtype = torch.float32 if weight.dtype in _LOW_PRECISION else weight.dtype
        dw = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        db = torch.zeros(bias.shape, dtype=acc_dtype, device=bias.device) if need_b else None
        chunk_tokens = even_chunk_tokens(n, chunk_tokens)  # the same count of mini-sequences, evened out
        for s in range(0, n, chunk_tokens):
            xc, yc = x[s : s + chunk_tokens], labels[s : s + chunk_tokens]  # [c, d], [c]
            z = F.linear(xc, weight, bias).float()  # [c, V] fp32: the only logits alive
            lc, gz = _logits_grad_(z, yc, ignore_index, transform, need_grad=need_any)  # gz is z, overwritten
            loss += lc
            if gz is None:
                continue
            g = gz.to(weight.dtype)
            del gz, z
            if need_x:
                torch.matmul(g, weight, out=dx[s : s + xc.shape[0]])  # [c, V] @ [V, d] -> [c, d]
            if need_w:
                if dw.dtype == g.dtype:
                    dw.addmm_(g.t(), xc)  # [V, c] @ [c, d] -> [V, d]
                else:
                    # 16-bit product in vocabulary slices: the temporary is [V/k, d], not another [V, d]
                    step = max(1, (_SLICE_BYTES // max(1, 2 * xc.shape[1])))
                    for v in range(0, dw.shape[0], step):
                        dw[v : v + step].add_(g[:, v : v + step].t() @ xc)  # [v', c] @ [c, d]
            if need_b:
                db.add_(g.sum(0))
            del g
        count = (labels != ignore_index).sum()
        ctx.mark_non_differentiable(count)
        # kept on ctx, not saved: backward consumes them (scales in place and gives them away)
        ctx.grads = [dx, dw, db]
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss, count

    @staticmethod
    def backward(ctx, g_loss: torch.Tensor, _g_count: Any):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(
                "the mini-sequence LM head's backward ran twice for one forward (retain_graph=True): its gradient "
                "accumulators are consumed by the first backward; run the forward again"
            )
        ctx.grads = None
        out = []
        for acc, dtype in zip(grads, ctx.dtypes):
            if acc is None:
                out.append(None)
            elif acc.dtype == dtype:
                out.append(acc.mul_(g_loss.to(dtype)))  # in place: the accumulator becomes the gradient
            else:
                # cast first, then scale: one temporary in the parameter's (16-bit) dtype, not an fp32 one as well
                out.append(acc.to(dtype).mul_(g_loss.to(dtype)))
        del grads
        gx, gw, gb = out
        return gx, None, gw, gb, None, None, None


def _logits_grad_(
    z: torch.Tensor, y: torch.Tensor, ignore_index: int, transform: "HeadTransform", *, need_grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum of CE(t(z), y) over rows with a target, d/dz of that sum) for fp32 logits z [c, V], IN PLACE.

    Note [Lean LM head]: autograd through ``F.cross_entropy`` keeps three [c, V] tensors beside the logits (the
    log-softmax it saves, the gradient of the NLL and the gradient it returns), four in all: what made the head the
    step's peak. Here the softmax is formed in z itself (exp of the shifted logits, normalised), the target
    entries get -1 and rows without a target 0: that is the gradient, returned as z. Soft-capping needs tanh's
    derivative, one more [c, V] buffer; the linear scalings fold into constants.
    """
    valid = y != ignore_index  # [c]
    target = torch.where(valid, y, torch.zeros_like(y)).unsqueeze(1)  # [c, 1], a valid index for ignored rows
    factor = 1.0  # d t(z) / dz of the linear scalings
    if transform.scale is not None:
        z.mul_(transform.scale)
        factor *= transform.scale
    if transform.divisor is not None:
        z.div_(transform.divisor)
        factor /= transform.divisor
    tanh = None
    if transform.softcap:
        tanh = z.div_(transform.softcap).tanh_().clone() if need_grad else z.div_(transform.softcap).tanh_()
        z.mul_(transform.softcap)
    z_target = z.gather(1, target).squeeze(1)  # [c]
    shift = z.amax(dim=1, keepdim=True)  # [c, 1]
    z.sub_(shift).exp_()  # exp(z - max) in place
    total = z.sum(dim=1, keepdim=True)  # [c, 1]
    lse = total.log().add_(shift).squeeze(1)  # [c]
    loss = torch.where(valid, lse - z_target, torch.zeros_like(lse)).sum()
    if not need_grad:
        return loss, None
    z.div_(total)  # softmax
    z.scatter_add_(1, target, torch.where(valid, -1.0, 0.0).to(z.dtype).unsqueeze(1))  # minus the one-hot target
    z.mul_(valid.unsqueeze(1))  # rows without a target: no gradient
    if tanh is not None:
        z.mul_(tanh.square_().neg_().add_(1.0))  # d(cap * tanh(u / cap)) / du = 1 - tanh^2
        del tanh
    if factor != 1.0:
        z.mul_(factor)
    return loss, z


@dataclass(frozen=True)
class HeadTransform:
    """What a model does to ``lm_head(h)`` before its loss, in the model's order: ``* scale`` (Cohere
    ``logit_scale``), ``/ divisor`` (Granite ``logits_scaling``), then ``tanh(z / softcap) * softcap`` (Gemma-2/3
    ``final_logit_softcapping``)."""

    scale: float | None = None
    divisor: float | None = None
    softcap: float | None = None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.scale is not None:
            z = z * self.scale
        if self.divisor is not None:
            z = z / self.divisor
        if self.softcap:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_tokens: int,
    ignore_index: int = -100,
    softcap: float | None = None,
    scale: float | None = None,
    divisor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 loss sum, int64 token count) of CE(hidden @ weight^T + bias, labels) in mini-sequences; the logits are
    first multiplied by ``scale``, divided by ``divisor`` and soft-capped by ``softcap`` (each when given).

    hidden: [..., S, d]; labels: [..., S] already shifted, ``ignore_index`` marks padding / no target.
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and labels {tuple(labels.shape)} must agree on [..., S]; labels are "
            f"already shifted (labels[..., i] is the target of position i)"
        )
    if weight.numel() == 0 and hasattr(weight, "ds_id"):
        raise RuntimeError(
            "LM-head weight is ZeRO-3 partitioned here: call apply_mini_sequence(model, ...) before "
            "deepspeed.initialize so the loss runs inside the lm_head module call (which gathers the weight)"
        )
    x = hidden.reshape(-1, hidden.shape[-1])  # [..., S, d] -> [T, d]
    y = labels.reshape(-1).to(device=x.device, dtype=torch.long)  # [..., S] -> [T]
    transform = HeadTransform(scale=scale, divisor=divisor, softcap=softcap or None)
    return _ChunkedLinearCrossEntropy.apply(x, y, weight, bias, int(chunk_tokens), int(ignore_index), transform)


# model_type prefix -> (attribute, how the model applies it), read off the models' forwards
_KNOWN_SCALES = {
    "granite": ("logits_scaling", "divisor"),  # granite, granitemoe*, granite_swa: logits / logits_scaling
    "cohere": ("logit_scale", "scale"),  # cohere, cohere2, cohere2_moe: logits * logit_scale
    "hyperclovax": ("logits_scaling", "scale"),  # hyperclovax (and its vision model): logits * logits_scaling
    "muse_": ("output_multiplier", "scale"),  # muse_glimmer, muse_spark: logits * output_multiplier, then soft-capped
}
_SCALE_KEYS = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier")


def _forward_reads(model: nn.Module, key: str) -> bool:
    """Whether the model's own forward names ``key``: a config value its forward never reads does not change its
    logits (Cohere2-Vision's text config carries a ``logit_scale`` that only Cohere's text forward applies)."""
    return _class_forward_reads(type(model), key)


@functools.lru_cache(maxsize=None)
def _class_forward_reads(cls: type, key: str) -> bool:
    """``_forward_reads`` per class, read once: ``head_transform`` runs at every loss computation, and reading the
    forward's source is file I/O."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return True
    return re.search(rf"\b{key}\b", src) is not None


def head_transform(model: nn.Module) -> HeadTransform:
    """The model's ``HeadTransform``: the scalings its config holds and its forward applies; NotImplementedError
    for a logit scaling of unknown semantics (the same attribute multiplies in one family and divides in another)."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return HeadTransform()
    text = text_config(cfg)
    mtype = str(getattr(text, "model_type", "") or "")
    kw: dict[str, float] = {}
    for key in _SCALE_KEYS:
        v = getattr(text, key, None)
        if v is None or v == 1.0 or not _forward_reads(model, key):
            continue
        known = next((how for prefix, (k, how) in _KNOWN_SCALES.items() if mtype.startswith(prefix) and k == key), None)
        if known is None:
            raise NotImplementedError(
                f"{type(model).__name__} scales its logits ({key}={v}) in a way the mini-sequence LM head does not "
                "reproduce"
            )
        kw[known] = float(v)
    softcap = getattr(text, "final_logit_softcapping", None) or None
    applied = softcap is not None and _forward_reads(model, "final_logit_softcapping")
    return HeadTransform(**kw, softcap=softcap if applied else None)


def _auto_chunk(head: nn.Linear) -> int:
    return auto_lm_head_chunk_tokens(head.out_features, DEFAULT_LOGITS_BUDGET_MIB)


def mini_sequence_causal_lm_loss(
    model: nn.Module,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, token_count) of the causal-LM head over ``hidden_states`` [..., S, d] (the backbone's output).

    ``labels`` [..., S] are ALREADY SHIFTED. ``chunk_tokens`` None uses the size set by ``apply_mini_sequence``
    (else the "auto" rule with a 256 MiB fp32-logits budget). Token mean = loss_sum / token_count; across
    sequence-parallel ranks all-reduce both first (docs/design/layouts.md).
    """
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"{type(model).__name__}.get_output_embeddings() is {type(head).__name__}; the mini-sequence LM head "
            f"needs an nn.Linear head"
        )
    if chunk_tokens is None:
        chunk_tokens = getattr(head, _MST_ATTR, None) or _auto_chunk(head)
    t = head_transform(model)
    if getattr(head, _MST_ATTR, None) is not None:
        # through the module call, so ZeRO-3 hooks gather the (possibly tied) weight for the whole loss
        return head(hidden_states, mst_labels=labels, mst_chunk_tokens=chunk_tokens, mst_ignore_index=ignore_index,
                    mst_softcap=t.softcap, mst_scale=t.scale, mst_divisor=t.divisor)
    return chunked_linear_cross_entropy(
        hidden_states, labels, head.weight, head.bias, chunk_tokens=chunk_tokens, ignore_index=ignore_index,
        softcap=t.softcap, scale=t.scale, divisor=t.divisor,
    )


def mini_sequence_lm_loss(
    model: nn.Module,
    *,
    labels: torch.Tensor | None = None,
    shift_labels: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    ignore_index: int = -100,
    **backbone_kwargs: Any,
) -> torch.Tensor:
    """Token-mean causal-LM loss of an HF ``*ForCausalLM`` without materialising full logits.

    Runs the backbone (``model.get_decoder()``) with ``backbone_kwargs`` (input_ids, attention_mask, position_ids,
    ...), then the mini-sequence head. Give exactly one of ``labels`` (HF convention, unshifted: shifted here) or
    ``shift_labels`` (already shifted). A batch with no target token gives 0 (not NaN). Single-process mean: with
    sequence parallelism use ``mini_sequence_causal_lm_loss`` and reduce across ranks.
    """
    if (labels is None) == (shift_labels is None):
        raise ValueError("give exactly one of labels (unshifted) or shift_labels (already shifted)")
    if shift_labels is None:
        # [..., S] -> [..., S]: position i predicts token i+1; the last position has no target
        shift_labels = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    out = model.get_decoder()(**backbone_kwargs)
    hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    loss_sum, count = mini_sequence_causal_lm_loss(
        model, hidden, shift_labels, chunk_tokens=chunk_tokens, ignore_index=ignore_index
    )
    return loss_sum / count.clamp(min=1)
