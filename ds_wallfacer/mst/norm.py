"""Lean RMSNorm: HF's RMSNorm forwards run in mini-sequences, saving only their input and one fp32 factor per row.

An HF RMSNorm under autograd saves fp32 copies of its input and of the normalised rows (3 layer inputs' worth in
bf16) and its backward makes four more of them; at long sequences these are most of a decoder layer's working set
(``benchmarks/bench_memory.py``). ``lean_rms_norm`` computes the same forward row by row in chunks of tokens, with
the same operations in the same order (bitwise the same output), keeps the input (already held by the layer) and
the reciprocal root mean square, and forms the input's gradient chunk by chunk from them. The weight's gradient is
accumulated in fp32 over the chunks.

Which modules qualify is read from their forward's code (``norm_form``): the four expressions transformers' RMSNorm
classes use (weight applied in the input's dtype, in fp32, as ``1 + weight`` in fp32). Any other is left alone.

Design: Note [Lean RMSNorm] in docs/design/memory.md.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["LeanNormForward", "NormForm", "chunk_rows", "lean_rms_norm", "norm_form"]


@dataclass(frozen=True)
class NormForm:
    """How a recognised RMSNorm applies its weight to the fp32 normalised rows ``n``."""

    eps_attr: str
    """The attribute holding epsilon."""
    scale: str
    """"cast": ``weight * n.to(dtype)`` (the multiply in the weight's dtype); "promote": ``(weight * n).to(dtype)``
    (type promotion); "fp32": ``(weight.float() * n).to(dtype)``; "one-plus": ``(n * (1 + weight.float())).to(dtype)``
    (Gemma)."""

    @property
    def fp32_scale(self) -> bool:
        return self.scale != "cast"

    def factor(self, weight: torch.Tensor) -> torch.Tensor:
        """What multiplies the fp32 rows in the "promote", "fp32" and "one-plus" forms."""
        if self.scale == "promote":
            return weight
        return 1.0 + weight.float() if self.scale == "one-plus" else weight.float()


_CORE = (r"variance=hidden_states\.pow\(2\)\.mean\(-1,keepdim=True\)"
         r"hidden_states=hidden_states\*torch\.rsqrt\(variance\+self\.variance_epsilon\)")
_LLAMA_HEAD = r"input_dtype=hidden_states\.dtypehidden_states=hidden_states\.to\(torch\.float32\)"
_FORMS: tuple[tuple[NormForm, re.Pattern], ...] = (
    (NormForm("variance_epsilon", "cast"),
     re.compile(_LLAMA_HEAD + _CORE + r"returnself\.weight\*hidden_states\.to\(input_dtype\)")),
    (NormForm("variance_epsilon", "promote"),
     re.compile(_LLAMA_HEAD + _CORE + r"return\(self\.weight\*hidden_states\)\.to\(input_dtype\)")),
    (NormForm("variance_epsilon", "fp32"),
     re.compile(_LLAMA_HEAD + _CORE
                + r"return\(self\.weight\.to\(torch\.float32\)\*hidden_states\)\.to\(input_dtype\)")),
    (NormForm("eps", "one-plus"),
     re.compile(r"output=self\._norm\(x\.float\(\)\)output=output\*\(1\.0\+self\.weight\.float\(\)\)"
                r"returnoutput\.type_as\(x\)")),
)
_GEMMA_NORM = re.compile(r"returnx\*torch\.rsqrt\(x\.pow\(2\)\.mean\(-1,keepdim=True\)\+self\.eps\)")


def _code(function: Callable) -> str | None:
    """A function's body without its signature, docstring, comments and whitespace (None: no source)."""
    try:
        src = inspect.getsource(function)
    except (OSError, TypeError):
        return None
    src = re.sub(r'""".*?"""', "", src, flags=re.S)
    src = re.sub(r"^\s*def\s+\w+\(.*?\)\s*(->[^:]*)?:", "", src, count=1, flags=re.S)
    return re.sub(r"\s+", "", "".join(line.split("#", 1)[0] for line in src.splitlines()))


def norm_form(module: nn.Module) -> NormForm | None:
    """The form of an HF RMSNorm ``module`` (None: not one this module computes): no children, one 1-D ``weight``
    and a forward (and for Gemma's form its ``_norm``) written as one of ``_FORMS``."""
    if any(True for _ in module.children()):
        return None
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if set(params) != {"weight"} or weight is None or weight.dim() != 1:
        return None
    forward = type(module).forward
    if "forward" in module.__dict__:  # an instance forward of someone else's
        return None
    code = _code(forward)
    if code is None:
        return None
    for form, pattern in _FORMS:
        if pattern.fullmatch(code) and isinstance(getattr(module, form.eps_attr, None), float):
            if form.scale == "one-plus" and not _GEMMA_NORM.fullmatch(_code(type(module)._norm) or ""):
                return None
            return form
    return None


def _normalise(x: torch.Tensor, rstd_out: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp32 normalised rows, the operations of the HF forwards in their order; writes 1/rms into ``rstd_out``."""
    x32 = x.to(torch.float32)
    r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if rstd_out is not None:
        rstd_out.copy_(r)
    return x32 * r


def _scaled(n32: torch.Tensor, weight: torch.Tensor, form: NormForm, dtype: torch.dtype) -> torch.Tensor:
    if not form.fp32_scale:
        return weight * n32.to(dtype)
    return (n32 * form.factor(weight) if form.scale == "one-plus" else form.factor(weight) * n32).to(dtype)


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float, form: NormForm, chunk: int):
        rows = x.reshape(-1, x.shape[-1])
        dtype = torch.promote_types(x.dtype, weight.dtype) if not form.fp32_scale else x.dtype
        out = torch.empty(rows.shape, dtype=dtype, device=x.device)
        rstd = torch.empty(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        for i in range(0, rows.shape[0], chunk):
            out[i:i + chunk] = _scaled(_normalise(rows[i:i + chunk], rstd[i:i + chunk], eps), weight, form, x.dtype)
        ctx.save_for_backward(x, rstd)
        # the parameter itself, not a saved copy: ZeRO-3 gathers it again before this module's backward
        ctx.weight, ctx.form, ctx.chunk = weight, form, chunk
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (x, rstd), weight = ctx.saved_tensors, ctx.weight
        form, chunk = ctx.form, ctx.chunk
        rows, grows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        dx = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        width = rows.shape[-1]
        factor = form.factor(weight) if form.fp32_scale else None  # once, not per chunk
        for i in range(0, rows.shape[0], chunk):
            x32, r, g = rows[i:i + chunk].to(torch.float32), rstd[i:i + chunk], grows[i:i + chunk]
            n32 = x32 * r
            if factor is not None:  # y = (factor * n).to(dtype): the multiply in the promoted dtype
                gp = g.to(torch.promote_types(factor.dtype, n32.dtype))
                if dw is not None:
                    dw += (gp * n32).to(torch.float32).sum(0)
                dn = (gp * factor).to(torch.float32)
            else:  # y = weight * n.to(dtype): the multiply's gradients in the weight's dtype, as autograd forms them
                if dw is not None:
                    dw += (g * n32.to(x.dtype)).to(torch.float32).sum(0)
                dn = (g * weight).to(x.dtype).to(torch.float32)  # autograd rounds it to the cast's dtype first
            if dx is None:
                continue
            # x * rsqrt(mean(x^2) + eps): the two paths of autograd's graph, summed
            dvar = (dn * x32).sum(-1, keepdim=True) * (-0.5 * r.pow(3))
            dx[i:i + chunk] = (dn * r + dvar * (2.0 / width) * x32).to(x.dtype)
        return (None if dx is None else dx.view_as(x), None if dw is None else dw.to(weight.dtype), None, None, None)


CHUNKS = 32
"""Chunks per call: the temporaries of one chunk (about six fp32 copies of its rows) stay near a fifth of the
input's size in fp32."""
MIN_CHUNK_ROWS = 1024
"""Fewer rows per chunk only cost kernel calls."""


def chunk_rows(rows: int) -> int:
    """Rows per chunk of ``lean_rms_norm`` for ``rows`` rows."""
    return max(MIN_CHUNK_ROWS, -(-rows // CHUNKS))


def lean_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, form: NormForm, *,
                  rows_per_chunk: int | None = None) -> torch.Tensor:
    """The RMSNorm of ``form`` over ``x``'s last dimension, in chunks of rows (``chunk_rows`` unless given);
    saves ``x`` and one fp32 factor per row for the backward."""
    rows = x.numel() // max(1, x.shape[-1])
    return _LeanRMSNorm.apply(x, weight, eps, form, max(1, rows_per_chunk or chunk_rows(rows)))


class LeanNormForward:
    """Instance ``forward`` of a recognised RMSNorm: ``lean_rms_norm`` with its own weight and epsilon."""

    def __init__(self, module: nn.Module, form: NormForm) -> None:
        self.module, self.form = module, form

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        return lean_rms_norm(x, m.weight, getattr(m, self.form.eps_attr), self.form)
