"""Calling a library's private attention functions whose signatures move between releases.

flash-attn 2, FlashAttention-3 and flash-attn-4 each rename, add and drop keyword arguments of their private
``_flash_attn_forward/_backward`` functions from release to release. The backends pass every argument they know
by name and let the probed signature decide what is sent. One torch quirk matters to all of them:
``torch.library.custom_op`` (what flash-attn >= 2.7 and FlashAttention-3 wrap these functions in) hides the
signature behind ``(*args, **kwargs)``, so the probe reads the wrapped function instead. Probes run once per
kernel object, never per call.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

__all__ = ["Signature"]


class Signature:
    """The parameters of one library function, probed once; ``call`` sends only the keywords it takes."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        target = getattr(fn, "_init_fn", fn)  # torch.library.custom_op: CustomOpDef keeps the original here
        params = inspect.signature(target).parameters
        self.names: frozenset[str] = frozenset(params)
        self.required: tuple[str, ...] = tuple(
            n for n, p in params.items()
            if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        )

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def call(self, **kwargs: Any) -> Any:
        """``fn`` with the keywords it accepts; a required parameter nobody named gets None (the optional
        tensors of varlen, paging, rotary and fp8 paths, which some releases declare without a default)."""
        args = {k: v for k, v in kwargs.items() if k in self.names}
        for name in self.required:
            args.setdefault(name, None)
        return self.fn(**args)

