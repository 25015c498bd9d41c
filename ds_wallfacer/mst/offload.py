"""Checkpointed layer inputs parked in host memory between a layer's forward and its recompute (``OffloadInputs``).

``OffloadInputs(inner)`` wraps a layer checkpoint function: torch's non-reentrant one or DeepSpeed's reentrant one
(``mst/checkpointing.py``). The layer input goes to host memory when the layer's forward has run; the checkpoint
keeps only a zero-element token in its place, and the layer function, recomputed in backward, takes the input back.
On CUDA
the copy out runs on a side stream into pinned memory (the device tensor is released once the copy is done, which
the caching allocator learns from ``record_stream``) and the copy back is issued on the compute stream after the copy
out completed; on CPU "host memory" is a second buffer, so the same bookkeeping runs (and is tested) there.

Gradients: ``_Park`` turns the input into the token and ``_Unpark`` the token into the input again inside the
checkpointed function. ``_Unpark``'s backward leaves the input's gradient with the parked entry, and ``_Park``'s
backward, which autograd runs after it (it needs the token's gradient), hands it on. The values are the same tensors
as without offload: offloaded runs equal the others bitwise.

Design: Note [Offloaded checkpoints] in docs/design/memory.md.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["OffloadInputs", "OffloadStats"]


class OffloadStats:
    """What one ``OffloadInputs`` moved: for tests and benchmarks."""

    def __init__(self) -> None:
        self.parked = 0
        """Layer inputs sent to host memory."""
        self.fetched = 0
        """Layer inputs brought back for a recompute."""
        self.host_bytes = 0
        """Bytes held in host memory now."""


class _Parked:
    """One layer input: on the device during its layer's forward, in host memory until its recompute."""

    def __init__(self, x: torch.Tensor, owner: "OffloadInputs") -> None:
        self.owner = owner
        self.device_x: torch.Tensor | None = x
        self.grad: torch.Tensor | None = None
        self.event: Any = None
        self.host = owner._host_buffer(x)
        if x.device.type == "cuda":
            stream = owner._side_stream(x.device)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                self.host.copy_(x, non_blocking=True)
            x.record_stream(stream)  # the allocator keeps x's memory until the copy on the side stream is done
            self.event = stream.record_event()
        else:
            self.host.copy_(x)
        owner.stats.parked += 1
        owner.stats.host_bytes += self.host.numel() * self.host.element_size()

    def release_device(self) -> None:
        """The layer's forward is over: only the host copy is kept."""
        self.device_x = None

    def fetch(self, device: torch.device) -> torch.Tensor:
        """The input on the device: the live tensor during the forward, else a copy back from host memory."""
        if self.device_x is not None:
            return self.device_x
        self.owner.stats.fetched += 1
        if device.type == "cuda":
            torch.cuda.current_stream(device).wait_event(self.event)
            return self.host.to(device, non_blocking=True)
        # CPU: a copy of its own, as on a device (the buffer goes back to the pool after the backward)
        return self.host.clone() if device.type == "cpu" else self.host.to(device)

    def done(self) -> None:
        """The input's gradient has been handed on: the host buffer can serve another input."""
        if self.host is not None:
            self.owner.stats.host_bytes -= self.host.numel() * self.host.element_size()
            self.owner._free.append(self.host)
            self.host = None


class _Park(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, parked: _Parked) -> torch.Tensor:
        ctx.parked = parked
        return x.new_empty(0)

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor):
        parked = ctx.parked
        grad, parked.grad = parked.grad, None
        parked.done()
        return grad, None


class _Unpark(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, token: torch.Tensor, parked: _Parked, device: torch.device) -> torch.Tensor:
        ctx.parked = parked
        return parked.fetch(device).view_as(parked.host)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        parked = ctx.parked
        parked.grad = grad if parked.grad is None else parked.grad + grad
        return grad.new_zeros(0), None, None


class OffloadInputs:
    """A checkpoint function (``inner(function, *args, **kwargs)``, reentrant or not) whose first positional
    argument, the layer input, waits in host memory between the forward and the recompute."""

    def __init__(self, inner: Callable) -> None:
        self.inner = inner
        self.stats = OffloadStats()
        self._free: list[torch.Tensor] = []
        self._streams: dict[torch.device, Any] = {}

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    def _host_buffer(self, x: torch.Tensor) -> torch.Tensor:
        for i, buf in enumerate(self._free):
            if buf.shape == x.shape and buf.dtype == x.dtype:
                return self._free.pop(i)
        return torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=x.device.type == "cuda")

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        x = args[0] if args else None
        if not (torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.numel()):
            return self.inner(function, *args, **kwargs)
        parked = _Parked(x, self)
        token = _Park.apply(x, parked)
        device = x.device

        def run(token: torch.Tensor, *rest: Any, **kw: Any) -> Any:
            return function(_Unpark.apply(token, parked, device), *rest, **kw)

        try:
            return self.inner(run, token, *args[1:], **kwargs)
        finally:
            parked.release_device()
