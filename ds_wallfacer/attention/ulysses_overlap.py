"""DeepSpeed-Ulysses with its all-to-alls hidden behind the attention: the heads each rank receives are cut into K
groups, and the all-to-all of one group is in flight while the kernels run on another (Note [Ulysses in head
groups]).

``overlapped_ulysses`` is what ``UlyssesAttention`` calls when its inner attention is local (Ulysses alone) and the
heads split into ``head_groups(...)`` > 1 groups. Shapes as in ``ulysses.py``; h_u = hq / U query and hk_u = hk' / U
kv heads per rank after the all-to-all, hg = h_u / K (and hk_u / K) per group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import CommLayer
from .residuals import residual_slot, tensor_key
from .sinks import sink_grad
from .local import local_backward, local_forward

__all__ = ["head_groups", "heads_in_order", "overlapped_ulysses", "rows_by_rank"]


def head_groups(requested: int, *, q_heads: int, kv_heads: int, degree: int) -> int:
    """K: ``requested`` when it divides both the query and the kv heads each rank holds after the all-to-all
    (``kv_heads`` after replication to the degree), else 1 (no overlap)."""
    hq_u, hk_u = q_heads // degree, kv_heads // degree
    k = int(requested)
    return k if k > 1 and hq_u % k == 0 and hk_u % k == 0 else 1


# Note [Ulysses in head groups]: attention is independent per head, so the heads a rank receives can be received,
# computed and sent back in K groups: all-to-all in of group j + 1 runs while the kernels compute group j, and the
# output of group j travels back while group j + 1 computes; the backward does the same with dO in and dq, dk, dv
# out. Group j of rank r's heads is heads [r h_u + j hg, r h_u + (j + 1) hg) of q (the kv heads likewise, so each
# group's grouped-query mapping is the model's), and every per-head result is what the one-group path computes: the
# results are the same (tests/attention/test_ulysses.py) and the bytes are the same, in K messages per direction
# instead of one. What stays exposed is the first group's all-to-all in and the last group's out (1/K of each; the
# rest is hidden, tests/comm/test_overlap.py). Every rank starts its all-to-alls in the same order (in 0, in 1,
# out 0, in 2, out 1, ..., out K-1). When hk' / U does not split (e.g. one kv head per rank) K is 1 and the plain
# path runs; the hybrid keeps the plain path too (its inner WallFacer attention overlaps its own ring).


def _rows_in(x: torch.Tensor, u: int, k: int, j: int) -> torch.Tensor:
    """[B, h, S_l, d] -> group j of every destination's heads, [U, B*hg*S_l*d] (row i goes to rank i)."""
    b, h, sl, d = x.shape
    return x.reshape(b, u, k, h // (u * k), sl, d)[:, :, j].transpose(0, 1).reshape(u, -1)


def heads_in_order(recv: torch.Tensor, shape, u: int, m: int) -> torch.Tensor:
    """Received [U(src), n] of one tensor with per-rank shape (B, hg, S_l, d) -> [B, hg, U*S_l, d] in sequence
    order (``ulysses.seq_to_heads``'s layout: chunk-major, each chunk's pieces by rank)."""
    b, h, sl, d = shape
    return recv.reshape(u, b, h, m, sl // m, d).permute(1, 2, 3, 0, 4, 5).reshape(b, h, u * sl, d)


def rows_by_rank(y: torch.Tensor, u: int, m: int) -> torch.Tensor:
    """Inverse of ``heads_in_order``: [B, hg, U*S_l, d] -> [U(dst), n], row i the tokens of rank i."""
    b, h, su, d = y.shape
    sl = su // u
    return y.reshape(b, h, m, u, sl // m, d).permute(3, 0, 1, 2, 4, 5).reshape(u, -1)


def _place(dst: torch.Tensor, recv: torch.Tensor, u: int, k: int, j: int) -> None:
    """Write received [U(src), B*hg*S_l*d] (rank i's group j heads of my tokens) into dst [B, h, S_l, d]."""
    b, h, sl, d = dst.shape
    hg = h // (u * k)
    dst.view(b, u, k, hg, sl, d)[:, :, j].copy_(recv.reshape(u, b, hg, sl, d).transpose(0, 1))


def _split(recv: torch.Tensor, shapes, u: int, m: int) -> list[torch.Tensor]:
    out, at = [], 0
    for shape in shapes:
        n = torch.Size(shape).numel()
        out.append(heads_in_order(recv[:, at:at + n], shape, u, m))
        at += n
    return out


def _pipeline(comm: CommLayer, group, k: int, message_in, compute, message_out) -> list[torch.Tensor]:
    """Run K groups: ``message_in(j)`` [U, n] goes out by all-to-all, ``compute(j, received)`` gives what
    ``message_out(j, result)`` [U, n'] sends back; returns the K received replies, in order."""
    incoming = [comm.all_to_all_start(message_in(0), group)]
    outgoing = []
    for j in range(k):
        got = incoming[j].wait()[0]
        if j + 1 < k:
            incoming.append(comm.all_to_all_start(message_in(j + 1), group))
        result = compute(j, got)
        comm.computed()
        outgoing.append(comm.all_to_all_start(message_out(j, result), group))
    return [p.wait()[0] for p in outgoing]


class _OverlappedFn(torch.autograd.Function):
    """Ulysses' all-to-all in, local attention and all-to-all out as one node, K head groups pipelined. Inside a
    checkpointed layer the first forward keeps what the backward needs and the output, and the recompute returns
    them without communicating (``residuals.py``)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, group, comm: CommLayer, kernel, k_groups: int, pieces: int, causal: bool,
                scale: float, calls, window, softcap: float):
        u, m, kk = dist.get_world_size(group), pieces, k_groups
        b, hq, sl, d = q.shape
        dv = v.shape[-1]
        hg, hkg = hq // (u * kk), k.shape[1] // (u * kk)
        has_sinks = sinks is not None
        slot = residual_slot("ulysses", comm, group, kernel, tensor_key(q, k, v, *([sinks] if has_sinks else [])),
                             kk, pieces, causal, scale, calls, window, softcap)
        if slot is not None and slot.replaying:
            out, *saved = slot.take()
        else:
            shapes = [(b, hg, sl, d), (b, hkg, sl, d), (b, hkg, sl, dv)]
            out = torch.empty((b, hq, sl, dv), dtype=q.dtype, device=q.device)
            saved = []

            def compute(j, got):
                qj, kj, vj = _split(got, shapes, u, m)
                sj = None if sinks is None else sinks[j * hg:(j + 1) * hg]
                oj, lj = local_forward(qj, kj, vj, sj, kernel, causal, scale, calls, window, softcap)
                saved.extend((qj, kj, vj, oj, lj))
                return oj

            with torch.no_grad(), comm.phase("forward"):
                replies = _pipeline(
                    comm, group, kk,
                    lambda j: torch.cat([_rows_in(x, u, kk, j) for x in (q, k, v)], dim=1),
                    compute, lambda j, oj: rows_by_rank(oj, u, m),
                )
                for j, recv in enumerate(replies):
                    _place(out, recv, u, kk, j)
            if slot is not None:
                slot.keep(out, *saved)
        ctx.save_for_backward(*saved, *([sinks] if has_sinks else []))
        ctx.group, ctx.comm, ctx.kernel, ctx.k_groups, ctx.pieces = group, comm, kernel, kk, m
        ctx.causal, ctx.scale, ctx.calls, ctx.window, ctx.softcap = causal, scale, calls, window, softcap
        ctx.has_sinks, ctx.slot = has_sinks, slot
        ctx.shapes = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx, dout):
        saved = list(ctx.saved_tensors)
        sinks = saved.pop() if ctx.has_sinks else None
        group, comm, kk, m = ctx.group, ctx.comm, ctx.k_groups, ctx.pieces
        u = dist.get_world_size(group)
        (qs, ks, vs, qd, kd, vd) = ctx.shapes
        dout = dout.to(qd)
        b, hq, sl, dvv = dout.shape
        hg = hq // (u * kk)
        dq = torch.empty(qs, dtype=qd, device=dout.device)
        dk = torch.empty(ks, dtype=kd, device=dout.device)
        dv = torch.empty(vs, dtype=vd, device=dout.device)
        dsinks = []

        def compute(j, got):
            qj, kj, vj, oj, lj = saved[5 * j:5 * j + 5]
            doj = heads_in_order(got, (b, hg, sl, dvv), u, m)
            if sinks is not None:
                dsinks.append(sink_grad(doj, oj, lj, sinks[j * hg:(j + 1) * hg]))
            return local_backward(doj, qj, kj, vj, oj, lj, ctx.kernel, ctx.causal, ctx.scale, ctx.calls, ctx.window,
                                  ctx.softcap)

        with torch.no_grad(), comm.phase("backward"):
            replies = _pipeline(
                comm, group, kk, lambda j: _rows_in(dout, u, kk, j), compute,
                lambda j, grads: torch.cat([rows_by_rank(g, u, m) for g in grads], dim=1),
            )
            for j, recv in enumerate(replies):
                at = 0
                for dst in (dq, dk, dv):
                    n = dst.numel() // (u * kk)  # per source rank: its group j heads of this rank's tokens
                    _place(dst, recv[:, at:at + n], u, kk, j)
                    at += n
        if ctx.slot is not None:
            ctx.slot.done()
        ds = torch.cat(dsinks) if sinks is not None else None
        return dq, dk, dv, ds, None, None, None, None, None, None, None, None, None, None


def overlapped_ulysses(q, k, v, sinks, *, group, comm: CommLayer, kernel, k_groups: int, pieces: int, causal: bool,
                       scale: float, calls, window, softcap: float) -> torch.Tensor:
    """Ulysses attention over ``group`` with the local kernel, K = ``k_groups`` head groups pipelined: q [B, hq, S_l,
    d], k / v [B, hk', S_l, d / dv] (kv heads already replicated to the degree), ``sinks`` this rank's [hq / U] or
    None -> out [B, hq, S_l, dv]."""
    return _OverlappedFn.apply(q, k, v, sinks, group, comm, kernel, k_groups, pieces, causal, scale, calls, window,
                               softcap)
