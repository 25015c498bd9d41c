"""Mini-sequence MLP (MsT): ``mini_sequence_mlp`` runs the model's own MLP over mini-sequences of ``chunk_tokens``
tokens under no_grad and saves only its input; backward recomputes each mini-sequence with grad, and the autograd
function RETURNS the parameter gradients, so ZeRO 1/2/3 and gradient accumulation see one ordinary gradient per
parameter per backward.

Design: docs/design/memory.md; how often the MLP runs, with and without layer checkpointing:
Note [Mini-sequence MLP under layer checkpointing]; Note [Lean MLP backward] below.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

__all__ = ["MiniSequenceMLPFunction", "check_position_wise", "even_chunk_tokens", "mini_sequence_mlp"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _rng_devices(x: torch.Tensor) -> list[int]:
    return [x.device.index if x.device.index is not None else torch.cuda.current_device()] if x.is_cuda else []


def _capture_rng(x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    # Dropout inside an MLP must draw the same mask in the recompute as in the forward.
    cuda = [torch.cuda.get_rng_state(d) for d in _rng_devices(x)]
    return torch.get_rng_state(), cuda


def even_chunk_tokens(n: int, chunk_tokens: int) -> int:
    """Tokens per mini-sequence for n tokens: the M = ceil(n / chunk_tokens) mini-sequences made as even as
    possible (ceil(n / M) tokens, the last one shorter by less than M): the largest one sets the memory, and it is
    no larger than needed (n = 2048 at 524 per chunk: 512, not 524)."""
    if n <= chunk_tokens:
        return max(1, n)
    return -(-n // -(-n // chunk_tokens))


def _chunks(n: int, chunk_tokens: int) -> range:
    # ceil(n / chunk) mini-sequences of even_chunk_tokens; n < chunk gives one (no dropped tail)
    return range(0, n, even_chunk_tokens(n, chunk_tokens))


def _output_like(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, *, zeros: bool) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])  # [T, d]
    # width and dtype of run's output from a zero-token call (free); RNG untouched so dropout replays exactly
    with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(x)):
        probe = run(flat[:0])  # [0, d] -> [0, d_out]
    new = x.new_zeros if zeros else x.new_empty
    # allocated in its final shape: an output that is a view would forbid the in-place fill (autograd view rules)
    return new(*x.shape[:-1], probe.shape[-1], dtype=probe.dtype)  # [..., S, d_out]


def _fill(out: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, chunk_tokens: int) -> None:
    flat, dst = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])  # [T, d], [T, d_out]
    c = even_chunk_tokens(flat.shape[0], chunk_tokens)
    with torch.no_grad():
        for s in _chunks(flat.shape[0], chunk_tokens):
            dst[s : s + c] = run(flat[s : s + c])  # [c, d] -> [c, d_out]


class MiniSequenceMLPFunction(torch.autograd.Function):
    """Saves x only and returns y's buffer UNCOMPUTED (zeros if ``placeholder``); ``mini_sequence_mlp`` fills it.

    Backward recomputes y = run(x) in mini-sequences with grad; parameter gradients are returned, not accumulated.
    Filling outside the function puts the save of x before the MLP's work
    (Note [Mini-sequence MLP under layer checkpointing] in docs/design/memory.md).
    """

    @staticmethod
    def forward(ctx, run, x: torch.Tensor, chunk_tokens: int, placeholder: bool, *params: torch.Tensor):
        ctx.run = run
        ctx.chunk_tokens = chunk_tokens
        # parameters are kept by reference, not saved: ZeRO-3 swaps their .data between gathered and partitioned
        ctx.params = params
        ctx.rng = _capture_rng(x)  # the fill right after apply draws from this same state
        ctx.save_for_backward(x)
        return _output_like(run, x, zeros=placeholder)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        need_x = ctx.needs_input_grad[1]
        need_p = ctx.needs_input_grad[4:]
        params = [p for p, need in zip(ctx.params, need_p) if need]
        flat = x.detach().reshape(-1, x.shape[-1])  # [T, d]
        g = grad_out.reshape(-1, grad_out.shape[-1])  # [T, d_out]
        dx = torch.empty_like(flat) if need_x else None
        acc = _GradAccumulators(len(params))
        cpu_rng, cuda_rng = ctx.rng
        devices = _rng_devices(x)
        handles = [p.register_hook(acc.hook(i)) for i, p in enumerate(params)]
        try:
            with torch.random.fork_rng(devices=devices):
                torch.set_rng_state(cpu_rng)
                for d, state in zip(devices, cuda_rng):
                    torch.cuda.set_rng_state(state, d)
                c = even_chunk_tokens(flat.shape[0], ctx.chunk_tokens)
                for s in _chunks(flat.shape[0], ctx.chunk_tokens):
                    xc = flat[s : s + c].requires_grad_(need_x)
                    with torch.enable_grad():
                        y = ctx.run(xc)  # intermediates of one mini-sequence only: [c, I]
                        inputs = ([xc] if need_x else []) + params
                        grads = torch.autograd.grad(y, inputs, g[s : s + xc.shape[0]], allow_unused=True)
                    if need_x:
                        dx[s : s + xc.shape[0]] = grads[0]
                    del y, grads  # the parameters' entries are stride-0 zeros: their values went to acc
        finally:
            for h in handles:
                h.remove()
        it = iter(acc.sums)
        param_grads = []
        for p, need in zip(ctx.params, need_p):
            gp = next(it) if need else None
            param_grads.append(gp.to(p.dtype) if gp is not None else None)
        dx_out = dx.view_as(x) if need_x else None
        return (None, dx_out, None, None, *param_grads)


class _GradAccumulators:
    """Per-parameter sums of the mini-sequences' gradients, added the moment autograd forms each one.

    Note [Lean MLP backward]: ``torch.autograd.grad`` hands back the gradients of all its inputs together at the
    end, so with three weight matrices each mini-sequence held three fresh [I, d] gradients beside the three sums
    (and the recomputed intermediates). A tensor hook on each parameter (run by ``autograd.grad`` before it
    captures a gradient) adds the gradient to the sum as soon as it exists and gives autograd a stride-0 zero
    tensor to capture instead, so at most one fresh gradient is alive. The first mini-sequence's gradient becomes
    the sum itself (no copy) unless it is 16-bit (summed in fp32: one rounding, like one big matmul) or aliases
    another sum.
    """

    def __init__(self, n: int) -> None:
        self.sums: list[torch.Tensor | None] = [None] * n

    def hook(self, i: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def add(grad: torch.Tensor) -> torch.Tensor:
            total = self.sums[i]
            if total is not None:
                total.add_(grad)
            elif grad.dtype in _LOW_PRECISION:
                self.sums[i] = grad.float()
            elif grad._base is not None or not grad.is_contiguous() or any(
                t is not None and t.data_ptr() == grad.data_ptr() for t in self.sums
            ):
                self.sums[i] = grad.clone(memory_format=torch.contiguous_format)  # a view, or shared: own it
            else:
                self.sums[i] = grad
            return grad.new_zeros(()).expand_as(grad)

        return add


def mini_sequence_mlp(
    run: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    *,
    chunk_tokens: int,
    placeholder: bool = False,
) -> torch.Tensor:
    """Apply the position-wise ``run`` (whose trainable tensors are ``params``) to x: [..., S, d] in mini-sequences.

    ``placeholder``: when autograd records the call, return zeros wired to the real backward instead of computing
    y; only for a checkpoint recompute that checks nothing uses the value (checkpointing.py).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be a positive integer, got {chunk_tokens}")
    for p in params:
        if p.numel() == 0 and hasattr(p, "ds_id"):
            raise RuntimeError(
                "mini-sequence MLP got a ZeRO-3 partitioned parameter: call apply_mini_sequence(model, ...) "
                "before deepspeed.initialize so that the MLP is registered as a ZeRO-3 leaf module"
            )
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        out = _output_like(run, x, zeros=False)
        _fill(out, run, x, chunk_tokens)
        return out
    out = MiniSequenceMLPFunction.apply(run, x, chunk_tokens, placeholder, *params)
    if not placeholder:
        # after apply, so after x is saved: torch's early-stopping recompute never gets here (docs/design/memory.md)
        _fill(out, run, x, chunk_tokens)
    return out


def check_position_wise(
    module: nn.Module, run: Callable[[torch.Tensor], torch.Tensor], hidden_size: int, *, tokens: int = 5
) -> str | None:
    """Return why ``run`` (the module's forward) is not position-wise on [1, tokens, hidden_size], or None if it is.

    Cheap probe: the output at every position must equal the output of that position alone. Returns None without
    probing when parameters are ZeRO-3 partitioned (nothing to run on).
    """
    ref = next(module.parameters(), None)
    if ref is not None and ref.numel() == 0:
        return None
    device = ref.device if ref is not None else torch.device("cpu")
    dtype = ref.dtype if ref is not None and ref.is_floating_point() else torch.float32
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, hidden_size, generator=gen).to(device=device, dtype=dtype)
    was_training = module.training
    module.eval()  # dropout would make any module look non-position-wise
    try:
        with torch.no_grad():
            y = run(x)
            if not isinstance(y, torch.Tensor):
                return f"its forward returns {type(y).__name__}, not one tensor"
            if y.shape[:-1] != x.shape[:-1]:
                return f"its forward maps {tuple(x.shape)} to {tuple(y.shape)}, not [..., S, d] -> [..., S, d']"
            alone = torch.cat([run(x[:, i : i + 1]) for i in range(tokens)], dim=1)
            # mini-sequences are fed flat, [c, d]: the module must take that shape too (a sparse-MoE block does not)
            try:
                flat = run(x[0])
            except Exception as e:  # noqa: BLE001 - as below: not an MLP we can chunk
                return f"its forward raised {type(e).__name__}: {e} on a flat [{tokens}, {hidden_size}] input"
            if not isinstance(flat, torch.Tensor) or flat.shape != y.shape[1:]:
                return f"on a flat [{tokens}, {hidden_size}] input its forward returns {getattr(flat, 'shape', flat)}"
            alone = torch.cat([alone, flat.unsqueeze(0)], dim=0)
            y = torch.cat([y, y], dim=0)
            err = (y.float() - alone.float()).abs().max().item()
            scale = max(1.0, y.float().abs().max().item())
            if not err <= tol * scale:
                return f"a position's output depends on other positions (max difference {err:.3g})"
    except Exception as e:  # noqa: BLE001 - any failure on a plain [1, S, d] input means "not an MLP we can chunk"
        return f"its forward raised {type(e).__name__}: {e} on a [1, {tokens}, {hidden_size}] input"
    finally:
        module.train(was_training)
    return None
