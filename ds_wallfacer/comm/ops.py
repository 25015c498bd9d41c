"""The one comm layer: every collective and send/recv of the package goes through a ``CommLayer``.

It counts the bytes this rank sends, by phase (forward / backward) and kind (``KINDS``), and the time it spent
blocked, and it checks that every tensor is on the group's device. Timeouts come from the process groups
(``groups.py`` creates them with one), so a dead peer ends a collective with an error instead of a hang.

Design: Note [What the comm layer counts] and Note [Measuring overlap] in docs/design/dependencies.md,
Note [Device of collective tensors] in docs/design/dependencies.md.
"""
from __future__ import annotations

import contextlib
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

__all__ = ["CommLayer", "KINDS", "OpRecord", "Pending", "all_gather_single", "backend_device_types", "exposed",
           "exposed_share", "reduce_scatter_single"]

KINDS = (
    "all_gather", "reduce_scatter", "ring", "skew", "fetch", "fetch_grad", "all_to_all", "halo", "heads", "check",
)
"""What the comm layer counts bytes by: the collectives, ring and skew hops of attention, the direct fetches of packed
or windowed batches and their dk/dv sent back (``attention/fetch.py``), Ulysses all-to-alls,
short-convolution halos (``mixers.short_conv``), the head-parallel all-to-alls of recurrent mixers
(``mixers.head_parallel``) and the cross-rank checks."""


# torch >= 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); older releases have only those.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def backend_device_types(backend: str) -> frozenset[str] | None:
    """Device types whose tensors a process-group backend accepts; None when it accepts any.

    ``backend`` as ``dist.get_backend`` names it: "nccl" (CUDA only), "gloo" (any: CPU, and CUDA for the
    collectives it implements), "mpi", or a per-device mapping such as "cpu:gloo,cuda:nccl".
    """
    name = backend.lower()
    if ":" in name:  # "cpu:gloo,cuda:nccl": each listed device type has a backend
        return frozenset(part.split(":", 1)[0].strip() for part in name.split(",") if ":" in part)
    if name in ("nccl", "xccl", "hccl"):
        return frozenset({"cuda"}) if name == "nccl" else frozenset({"xpu" if name == "xccl" else "hpu"})
    return None


@dataclass(frozen=True)
class OpRecord:
    """One communication of a recorded run (``CommLayer.recording``): its phase and kind, and how many compute calls
    (``CommLayer.computed``) this rank had made when it was issued and when it was waited on."""

    phase: str
    kind: str
    issued: int
    waited: int
    moved: int = 0
    """Bytes this rank sent and received in it."""

    @property
    def hidden(self) -> bool:
        """Some compute ran between issue and wait (a blocking collective never has any)."""
        return self.waited > self.issued


def exposed(records: Sequence[OpRecord], *, skip: Sequence[str] = ("check",)) -> list[tuple[str, str]]:
    """(phase, kind) of each recorded communication that no compute overlapped, in order; ``skip``: kinds left out
    (the batch checks, which run before any attention)."""
    return [(r.phase, r.kind) for r in records if not r.hidden and r.kind not in skip]


def exposed_share(records: Sequence[OpRecord], *, skip: Sequence[str] = ("check",)) -> float:
    """The share of the bytes moved (sent and received) in communications that no compute overlapped: a property of
    the schedule, the same on every run (0 when nothing moved)."""
    kept = [r for r in records if r.kind not in skip]
    total = sum(r.moved for r in kept)
    return sum(r.moved for r in kept if not r.hidden) / total if total else 0.0


@dataclass
class Pending:
    """Outstanding send/recv of one ``CommLayer.exchange``; ``wait()`` before reading the receive buffers."""

    works: list
    recvs: list[torch.Tensor]
    keep: list[torch.Tensor]
    """Send buffers, held until the sends complete."""

    done: bool = False
    on_wait: Callable[[float], None] | None = field(default=None, repr=False)
    """Called with the seconds ``wait`` blocked (the comm layer's ``blocked_s`` accounting)."""

    def wait(self) -> list[torch.Tensor]:
        """Complete the exchange once; a second wait is a bug in the caller's schedule and raises."""
        if self.done:
            raise RuntimeError("Pending.wait() called twice on one exchange: each exchange is waited on exactly once")
        t0 = time.perf_counter()
        for w in self.works:
            w.wait()
        if self.on_wait is not None and self.works:
            self.on_wait(time.perf_counter() - t0)
        self.works, self.keep, self.done = [], [], True
        return self.recvs


class CommLayer:
    """Counted collectives. Holds no process groups itself: each call names the group it runs on."""

    def __init__(self, *, device: torch.device | str | None = None, serial: bool = False) -> None:
        self.device: torch.device | None = torch.device(device) if device is not None else None
        """The device every collective tensor must be on (None: any device the group's backend accepts)."""
        self.serial = serial
        """True: ``exchange`` completes before it returns, so no transfer overlaps compute
        (Note [Measuring overlap]); settable at any time, it changes neither the bytes nor the results."""
        self.sent: Counter[tuple[str, str]] = Counter()
        """Bytes sent by this rank, keyed by (phase, kind)."""
        self.calls: Counter[tuple[str, str]] = Counter()
        self.blocked_s: Counter[tuple[str, str]] = Counter()
        """Seconds this rank was blocked waiting for communication, keyed by (phase, kind)
        (Note [Measuring overlap]): in ``Pending.wait`` for exchanges, inside the call for the blocking collectives."""
        self.checked = 0
        """Tensors whose device was checked (Note [Device of collective tensors])."""
        self.compute_calls = 0
        """Attention kernel calls made so far (``computed``): what a transfer can hide behind."""
        self.timeline: list[OpRecord] | None = None
        """With ``recording`` on: every communication in order (Note [Which transfers are exposed])."""
        self._phase = "forward"
        self._backend_types: dict[int, tuple[str, frozenset[str] | None]] = {}

    # -- devices ---------------------------------------------------------------------------------
    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the layer's device (for tensors that describe host data, e.g. batch signatures)."""
        return t if self.device is None else t.to(self.device)

    def check_device(self, op: str, group: dist.ProcessGroup | None, *tensors: torch.Tensor) -> None:
        """Raise ValueError unless every tensor is on the layer's device and of a type ``group``'s backend
        accepts (Note [Device of collective tensors])."""
        backend, types = self._group_types(group)
        for t in tensors:
            self.checked += 1
            dev = t.device
            wrong_layer = self.device is not None and (
                dev.type != self.device.type
                or (self.device.index is not None and dev.index is not None and dev.index != self.device.index)
            )
            if wrong_layer or (types is not None and dev.type not in types):
                want = str(self.device) if self.device is not None else " or ".join(sorted(types or ()))
                raise ValueError(
                    f"CommLayer.{op}: a tensor of shape {tuple(t.shape)} on {dev} was handed to a collective of a "
                    f"{backend} group, whose tensors must be on {want}; build it with device= taken from the data "
                    f"it describes, or move host data with CommLayer.place"
                )

    def _group_types(self, group: dist.ProcessGroup | None) -> tuple[str, frozenset[str] | None]:
        key = id(group)
        if key not in self._backend_types:
            backend = str(dist.get_backend(group)) if dist.is_initialized() else "unknown"
            self._backend_types[key] = (backend, backend_device_types(backend))
        return self._backend_types[key]

    # -- accounting ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        prev, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = prev

    def computed(self, calls: int = 1) -> None:
        """Note that the attention ran a kernel call: a transfer in flight across it is hidden behind compute."""
        self.compute_calls += calls

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[OpRecord]]:
        """Record every communication inside the block (``OpRecord``s, in order), into the list it yields."""
        prev, self.timeline = self.timeline, []
        try:
            yield self.timeline
        finally:
            self.timeline = prev

    def _blocked(self, key: tuple[str, str], moved: int = 0) -> Callable[[float], None]:
        issued = self.compute_calls

        def add(seconds: float) -> None:
            self.blocked_s[key] += seconds
            if self.timeline is not None:
                self.timeline.append(OpRecord(key[0], key[1], issued, self.compute_calls, moved))

        return add

    @contextlib.contextmanager
    def _timed(self, kind: str, moved: int = 0) -> Iterator[None]:
        key = (self._phase, kind)  # the phase of the call, fixed before it runs
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s[key] += time.perf_counter() - t0
            if self.timeline is not None:
                self.timeline.append(OpRecord(key[0], kind, self.compute_calls, self.compute_calls, moved))

    def _count(self, kind: str, nbytes: int) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown comm kind {kind!r}; expected one of {KINDS}")
        self.sent[(self._phase, kind)] += nbytes
        self.calls[(self._phase, kind)] += 1

    def reset(self) -> None:
        """Forget the counted bytes, calls and blocked time (e.g. at the start of a step)."""
        self.sent.clear()
        self.calls.clear()
        self.blocked_s.clear()

    def by_kind(self, phase: str) -> dict[str, int]:
        """Bytes sent in ``phase`` per kind (every kind listed, zeros included)."""
        return {k: self.sent.get((phase, k), 0) for k in KINDS}

    def blocked_by_kind(self, phase: str) -> dict[str, float]:
        """Seconds blocked in ``phase`` per kind (every kind listed, zeros included)."""
        return {k: self.blocked_s.get((phase, k), 0.0) for k in KINDS}

    # -- collectives -----------------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, group: dist.ProcessGroup, *, kind: str = "all_gather") -> torch.Tensor:
        """[*s] on each of n ranks -> [n, *s], in group-rank order."""
        n = dist.get_world_size(group)
        x = x.contiguous()
        self.check_device("all_gather", group, x)
        if n == 1:
            return x.unsqueeze(0)
        flat = x.reshape(-1)
        out = torch.empty(n * flat.numel(), dtype=x.dtype, device=x.device)
        with self._timed(kind, 2 * (n - 1) * _nbytes(x)):
            all_gather_single(out, flat, group=group)
        self._count(kind, (n - 1) * _nbytes(x))
        return out.view(n, *x.shape)

    def all_gather_object(self, obj: Any, group: dist.ProcessGroup) -> list:
        """A picklable object on each of n ranks -> the n objects, in group-rank order (copies, this rank's too).
        Two ``all_gather``s on the layer's device, of the pickles' sizes and of their bytes: an NCCL group takes
        no CPU tensors, which ``torch.distributed.all_gather_object`` would need the current device set for."""
        data = pickle.dumps(obj)
        n = dist.get_world_size(group)
        if n == 1:
            return [pickle.loads(data)]
        sizes = self.all_gather(self.place(torch.tensor([len(data)], dtype=torch.int64)), group).cpu()[:, 0]
        buf = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        every = self.all_gather(self.place(buf), group).cpu()  # [n, longest pickle]
        return [pickle.loads(every[r, : int(sizes[r])].numpy().tobytes()) for r in range(n)]

    def reduce_scatter(self, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        """[n, *s] on each of n ranks -> [*s]: the sum over ranks of slice ``group_rank``."""
        n = dist.get_world_size(group)
        if x.shape[0] != n:
            raise ValueError(f"reduce_scatter input has leading dim {x.shape[0]}, group size is {n}")
        self.check_device("reduce_scatter", group, x)
        if n == 1:
            return x[0]
        out = torch.empty(x[0].numel(), dtype=x.dtype, device=x.device)
        flat = x.contiguous().view(-1)
        with self._timed("reduce_scatter", 2 * (n - 1) * _nbytes(out)):
            reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=group)
        self._count("reduce_scatter", (n - 1) * _nbytes(out))
        return out.view(x.shape[1:])

    def all_reduce(self, x: torch.Tensor, group: dist.ProcessGroup, *, kind: str) -> torch.Tensor:
        """[*s] on each of n ranks -> their sum [*s] (a new tensor; ``x`` is left as it was)."""
        n = dist.get_world_size(group)
        self.check_device("all_reduce", group, x)
        out = x.clone(memory_format=torch.contiguous_format)
        if n == 1:
            return out
        with self._timed(kind, 4 * (n - 1) * _nbytes(out) // n):
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        self._count(kind, 2 * (n - 1) * _nbytes(out) // n)  # what a ring all-reduce sends per rank
        return out

    def all_to_all(
        self, x: torch.Tensor, group: dist.ProcessGroup, *, out: torch.Tensor | None = None, kind: str = "all_to_all"
    ) -> torch.Tensor:
        """[n, *s] -> [n, *s]: slice i goes to group rank i; slice j of the result came from rank j (counted as
        ``kind``)."""
        n = dist.get_world_size(group)
        self.check_device("all_to_all", group, x, *([] if out is None else [out]))
        if n == 1:
            return x if out is None else out.copy_(x)
        x = x.contiguous()
        out = torch.empty_like(x) if out is None else out
        with self._timed(kind, 2 * (n - 1) * _nbytes(x) // n):
            dist.all_to_all_single(out, x, group=group)
        self._count(kind, (n - 1) * _nbytes(x) // n)
        return out

    def all_to_all_start(self, x: torch.Tensor, group: dist.ProcessGroup, *, kind: str = "all_to_all") -> Pending:
        """``all_to_all`` started and not waited on: ``wait()`` returns [the result]. Every rank of ``group`` must
        start its all-to-alls in the same order. With ``serial`` set it completes here, like ``exchange``."""
        n = dist.get_world_size(group)
        self.check_device("all_to_all", group, x)
        x = x.contiguous()
        out = torch.empty_like(x)
        if n == 1:
            return Pending(works=[], recvs=[out.copy_(x)], keep=[])
        work = dist.all_to_all_single(out, x, group=group, async_op=True)
        self._count(kind, (n - 1) * _nbytes(x) // n)
        pending = Pending(works=[work], recvs=[out], keep=[x],
                          on_wait=self._blocked((self._phase, kind), 2 * (n - 1) * _nbytes(x) // n))
        if self.serial:
            pending = Pending(works=[], recvs=pending.wait(), keep=[])
        return pending

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
        *,
        kind: str,
        group: dist.ProcessGroup,
    ) -> Pending:
        """Start point-to-point sends and receives (global peer ranks); returns a handle to ``wait`` on.

        A send to oneself must pair with a receive from oneself: it becomes a local copy, uncounted. With
        ``serial`` set the transfer completes here (its blocked time counted now) and ``wait`` only hands back
        the receive buffers.
        """
        me = dist.get_rank()
        self.check_device("exchange", group, *(t for t, _ in sends), *(t for t, _ in recvs))
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
        moved = sum(_nbytes(t) for t in keep) + sum(_nbytes(t) for t, peer in recvs if peer != me)
        pending = Pending(works=list(works), recvs=[t for t, _ in recvs], keep=keep,
                          on_wait=self._blocked((self._phase, kind), moved))
        if self.serial and pending.works:
            # complete now, keep the handle's contract: the caller still waits exactly once
            recv_bufs = pending.wait()
            pending = Pending(works=[], recvs=recv_bufs, keep=[])
        return pending
