"""The one comm layer: every collective and send/recv of the package goes through a ``CommLayer``.

It counts the bytes *this rank sends*, by phase (forward / backward) and kind, so that tests assert exact
volumes and benchmarks print them beside the cost formulas:

- ``all_gather``     (n-1) * local bytes, for a group of n (what a ring all-gather sends per rank)
- ``reduce_scatter`` (n-1) * output bytes
- ``ring``           k/v (and dk/dv) blocks sent to the next rank of a sub-ring
- ``skew``           the initial k/v block sent across team groups, and dk/dv sent home in backward
- ``all_to_all``     (n-1)/n * local bytes (the part that leaves the rank)
- ``check``          the small metadata all-gather that validates inputs across ranks

Timeouts come from the process groups (``groups.py`` creates them with one), so a dead peer ends a
collective with an error instead of a hang.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["CommLayer", "KINDS", "Pending"]

KINDS = ("all_gather", "reduce_scatter", "ring", "skew", "all_to_all", "check")


# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class Pending:
    """Outstanding send/recv of one ``CommLayer.exchange``; ``wait()`` before reading the receive buffers."""

    works: list
    recvs: list[torch.Tensor]
    keep: list[torch.Tensor]
    """Send buffers, held until the sends complete."""

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.works, self.keep = [], []
        return self.recvs


class CommLayer:
    """Counted collectives. Holds no process groups itself: each call names the group it runs on."""

    def __init__(self) -> None:
        self.sent: Counter[tuple[str, str]] = Counter()
        """Bytes sent by this rank, keyed by (phase, kind)."""
        self.calls: Counter[tuple[str, str]] = Counter()
        self._phase = "forward"

    # -- accounting ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    def _count(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown comm kind {kind!r}; expected one of {KINDS}")
        self.sent[(self._phase, kind)] += nbytes
        self.calls[(self._phase, kind)] += 1

    def reset(self) -> None:
        self.sent.clear()
        self.calls.clear()

    def by_kind(self, phase: str) -> dict[str, int]:
        """Bytes sent in ``phase`` per kind (every kind listed, zeros included)."""
        return {k: self.sent.get((phase, k), 0) for k in KINDS}

    # -- collectives -----------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, group: dist.ProcessGroup, *, kind: str = "all_gather") -> torch.Tensor:
        """[*s] on each of n ranks -> [n, *s], in group-rank order."""
        n = dist.get_world_size(group)
        x = x.contiguous()
        if n == 1:
            return x.unsqueeze(0)
        flat = x.reshape(-1)
        out = torch.empty(n * flat.numel(), dtype=x.dtype, device=x.device)
        _all_gather(out, flat, group=group)
        self._count(kind, (n - 1) * _nbytes(x))
        return out.view(n, *x.shape)

    def reduce_scatter(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """[n, *s] on each of n ranks -> [*s]: the sum over ranks of slice ``group_rank``."""
        n = dist.get_world_size(group)
        if x.shape[0] != n:
            raise ValueError(f"reduce_scatter input has leading dim {x.shape[0]}, group size is {n}")
        if n == 1:
            return x[0]
        out = torch.empty(x[0].numel(), dtype=x.dtype, device=x.device)
        _reduce_scatter(out, x.contiguous().view(-1), op=dist.ReduceOp.SUM, group=group)
        self._count("reduce_scatter", (n - 1) * _nbytes(out))
        return out.view(x.shape[1:])

    def all_to_all(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[n, *s] -> [n, *s]: slice i goes to group rank i; slice j of the result came from rank j."""
        n = dist.get_world_size(group)
        if n == 1:
            return x if out is None else out.copy_(x)
        x = x.contiguous()
        out = torch.empty_like(x) if out is None else out
        dist.all_to_all_single(out, x, group=group)
        self._count("all_to_all", (n - 1) * _nbytes(x) // n)
        return out

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        *,
        kind: str,
        group: dist.ProcessGroup,
    ) -> Pending:
        """Start point-to-point sends and receives (global peer ranks); returns a handle to ``wait`` on.

        A send to oneself must pair with a receive from oneself: it becomes a local copy, uncounted.
        """
        me = dist.get_rank()
        self_sends = [t for t, peer in sends if peer == me]
        self_recvs = [t for t, peer in recvs if peer == me]
        if len(self_sends) != len(self_recvs):
            raise ValueError("a send to oneself needs a matching receive from oneself")
        for src, dst in zip(self_sends, self_recvs):
            dst.copy_(src)
        keep = [t.contiguous() for t, peer in sends if peer != me]
        peers = [peer for _, peer in sends if peer != me]
        ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in zip(keep, peers)]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs if peer != me]
        for t in keep:
            self._count(kind, _nbytes(t))
        works = dist.batch_isend_irecv(ops) if ops else []
        return Pending(works=list(works), recvs=[t for t, _ in recvs], keep=keep)
