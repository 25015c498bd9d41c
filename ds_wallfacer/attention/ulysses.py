"""DeepSpeed-Ulysses sequence parallelism over our counted comm layer.

``UlyssesAttention`` wraps any attention over the gathered sequence and takes its process group explicitly: one
all-to-all (q, k and v in one collective) turns sequence shards into head shards, the inner attention runs, a second
all-to-all turns the output back; with local inner attention in K head groups, overlapped (``ulysses_overlap.py``).
``LocalAttention`` (``local.py``) is the attention of a one-rank group and Ulysses' usual inner attention.

Dimensions: B batch, hq / hk query / kv heads, d head dim (v and the output may have their own, dv), U Ulysses
degree (group size), S_l tokens per rank, S_u = U * S_l tokens after the all-to-all; tensors are [B, h, S, d].

Design: Note [Ulysses all-to-all] in docs/design/layouts.md (grouped-query heads, sequence order).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ..comm import CommLayer
from .checks import check_inputs_agree, local_error
from .documents import SequenceBatch
from .local import LocalAttention, local_calls
from .residuals import residual_slot, tensor_key
from .ulysses_overlap import head_groups, heads_in_order, overlapped_ulysses, rows_by_rank

__all__ = ["InnerAttention", "LocalAttention", "UlyssesAttention", "all_to_all", "heads_to_seq", "seq_to_heads"]


class InnerAttention(Protocol):
    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
        batch: SequenceBatch | None = None, window: int | None = None, softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class _AllToAll(torch.autograd.Function):
    """[U, n] -> [U, n]: row i goes to group rank i, row j of the result came from rank j. Its own adjoint.

    Inside a checkpointed layer the first forward keeps what it received and the recompute returns it without
    communicating (``residuals.py``): the head-sharded q, k, v and the sequence-sharded output are what the inner
    attention's backward and the layer after attention need."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommLayer, group: dist.ProcessGroup, kind: str) -> torch.Tensor:
        ctx.comm, ctx.group, ctx.kind = comm, group, kind
        ctx.slot = slot = residual_slot("all_to_all", comm, group, tensor_key(x))
        if slot is not None and slot.replaying:
            return slot.take()[0]
        with comm.phase("forward"):
            out = comm.all_to_all(x, group, kind=kind)
        if slot is not None:
            slot.keep(out)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        with ctx.comm.phase("backward"):
            dx = ctx.comm.all_to_all(g.contiguous(), ctx.group, kind=ctx.kind)
        if ctx.slot is not None:
            ctx.slot.done()
        return dx, None, None, None


def all_to_all(x: torch.Tensor, group: dist.ProcessGroup, comm: CommLayer, *, kind: str = "all_to_all"
               ) -> torch.Tensor:
    """Differentiable, counted all-to-all of a [U, ...] tensor over ``group`` (U ranks), counted as ``kind``."""
    return _AllToAll.apply(x, comm, group, kind)


def _replicate_kv(x: torch.Tensor, degree: int) -> torch.Tensor:
    """[B, hk, S, d] -> [B, max(hk, U), S, d]: each kv head repeated U / hk times when hk < U."""
    hk = x.shape[1]
    return x if hk % degree == 0 else x.repeat_interleave(degree // hk, dim=1)


def seq_to_heads(
    xs: list[torch.Tensor], *, group: dist.ProcessGroup, comm: CommLayer, degree: int, pieces: int = 2
) -> list[torch.Tensor]:
    """Sequence shards -> head shards, all tensors in one all-to-all.

    Each x: [B, h, S_l, d] (h divisible by U; ``pieces`` m pieces per rank) -> [B, h/U, U*S_l, d], pieces put in
    sequence order.
    """
    m = pieces
    u = degree
    shapes = [x.shape for x in xs]
    # [B, h, S_l, d] -> [U, B, h/U, S_l, d] -> [U, n_x]; packed: [U, sum n_x]
    rows = [x.reshape(s[0], u, s[1] // u, s[2], s[3]).transpose(0, 1).reshape(u, -1) for x, s in zip(xs, shapes)]
    recv = all_to_all(torch.cat(rows, dim=1), group, comm)
    out, i = [], 0
    for s in shapes:
        shape = (s[0], s[1] // u, s[2], s[3])
        n = torch.Size(shape).numel()
        out.append(heads_in_order(recv[:, i : i + n], shape, u, m))  # chunk-major, pieces of each chunk by rank
        i += n
    return out


def heads_to_seq(
    x: torch.Tensor, *, group: dist.ProcessGroup, comm: CommLayer, degree: int, pieces: int = 2
) -> torch.Tensor:
    """Inverse of ``seq_to_heads`` for one tensor: [B, h/U, U*S_l, d] -> [B, h, S_l, d]."""
    u, m = degree, pieces
    b, h, su, d = x.shape
    sl = su // u
    recv = all_to_all(rows_by_rank(x, u, m), group, comm)  # row j: head group j of my tokens
    # [U, B, h/U, S_l, d] -> [B, U*(h/U), S_l, d]
    return recv.reshape(u, b, h, sl, d).transpose(0, 1).reshape(b, u * h, sl, d)


@dataclass(eq=False)
class UlyssesAttention:
    """Ulysses over ``group`` (U ranks) around ``inner`` attention: ``attn(q, k, v, causal=..., scale=...)``
    with q [B, hq, S_l, d], k/v [B, hk, S_l, d] (this rank's two pieces) -> out [B, hq, S_l, d]."""

    group: dist.ProcessGroup
    inner: Callable
    """Attention over the gathered sequence: ``LocalAttention`` (Ulysses alone) or a ``WallFacerAttention``
    over the ring ranks (hybrid)."""
    comm: CommLayer = field(default_factory=CommLayer)
    check_group: dist.ProcessGroup | None = None
    """Ranks whose inputs must agree (the whole sequence-parallel group in the hybrid, so that a mismatch between
    two Ulysses groups fails before the ring's collectives); None: ``group``."""
    check_inputs: bool = True
    """Validate shapes and dtypes across ranks (one small all-gather per new input signature)."""
    head_groups: int = 2
    """K: with local inner attention, the received heads are computed in K groups, each group's all-to-all in
    flight while another computes (``ulysses_overlap.py``, Note [Ulysses in head groups]); 1, or heads that do not
    split into K groups on every rank: one all-to-all each way."""
    _checked: set = field(default_factory=set, repr=False)

    @property
    def degree(self) -> int:
        return dist.get_world_size(self.group)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, scale: float | None = None,
        batch: SequenceBatch | None = None, window: int | None = None, softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``sinks`` [hq]: each rank applies those of the heads it holds after the all-to-all (``sinks.py``)."""
        u = self.degree
        if self.check_inputs:
            self._check(q, k, v, causal)
        opts = dict(causal=causal, scale=scale, batch=batch, window=window, softcap=softcap)
        if u == 1:
            return self.inner(q, k, v, **opts, sinks=sinks)
        if sinks is not None:  # [hq] -> this rank's head group [hq/U] (seq_to_heads sends head group i to rank i)
            per = q.shape[1] // u
            opts["sinks"] = sinks.narrow(0, dist.get_rank(self.group) * per, per)
        m = len(batch.assignment[0]) if batch is not None and batch.assignment is not None else 2  # pieces per rank
        k, v = _replicate_kv(k, u), _replicate_kv(v, u)
        if isinstance(self.inner, LocalAttention):
            groups = head_groups(self.head_groups, q_heads=q.shape[1], kv_heads=k.shape[1], degree=u)
            if groups > 1:
                softcap = float(softcap or 0.0)
                return overlapped_ulysses(
                    q, k, v, opts.get("sinks"), group=self.group, comm=self.comm,
                    kernel=self.inner.kernel_for(q, v, window, softcap), k_groups=groups, pieces=m, causal=causal,
                    scale=q.shape[-1] ** -0.5 if scale is None else float(scale),
                    calls=local_calls(q.shape[0], u * q.shape[2], causal, batch, window), window=window,
                    softcap=softcap,
                )
        qh, kh, vh = seq_to_heads([q, k, v], group=self.group, comm=self.comm, degree=u, pieces=m)
        out = self.inner(qh, kh, vh, **opts)  # [B, hq/U, U*S_l, d]
        return heads_to_seq(out, group=self.group, comm=self.comm, degree=u, pieces=m)

    def _check(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
        u = self.degree
        error = local_error(q, k, v)
        if error is None and (q.shape[1] % u or (k.shape[1] % u and u % k.shape[1])):
            error = (f"Ulysses degree {u} must divide the {q.shape[1]} query heads and divide or be a multiple of "
                     f"the {k.shape[1]} kv heads")
        group = self.check_group if self.check_group is not None else self.group
        check_inputs_agree(q, k, v, causal=causal, error=error, who="Ulysses attention", comm=self.comm, group=group,
                           checked=self._checked)
