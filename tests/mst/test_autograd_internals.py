"""The private autograd details that ``mst/checkpointing.py`` relies on, checked directly so that a torch release
that changes them fails here, loudly and by name, instead of silently recomputing a layer twice (or not at all).

``setup.py`` pins the torch range these were checked on; widen it only after this file passes on the new release.
"""
from __future__ import annotations

import torch

from ds_wallfacer.mst.checkpointing import _nothing_saved_after, _saves_tensor


class _SavesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class _SavesNothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_built_in_nodes_expose_raw_saved_slots() -> None:
    x = torch.randn(3, requires_grad=True)
    y = torch.randn(3, requires_grad=True)
    mul = (x * y).grad_fn
    add = (x + y).grad_fn
    assert any(n.startswith("_raw_saved_") for n in dir(mul)), f"{type(mul).__name__} has no _raw_saved_* slots"
    assert mul._saved_self is not None and mul._saved_other is not None, "_saved_<name> no longer gives the tensor"
    assert not any(n.startswith("_raw_saved_") for n in dir(add)), "AddBackward0 now saves a tensor"
    assert _saves_tensor(mul) and not _saves_tensor(add)


def test_custom_function_nodes_are_their_ctx() -> None:
    x = torch.randn(3, requires_grad=True)
    saving, plain = _SavesInput.apply(x).grad_fn, _SavesNothing.apply(x).grad_fn
    assert isinstance(saving, torch.autograd.function.BackwardCFunction), type(saving)
    assert len(saving.saved_tensors) == 1 and len(plain.saved_tensors) == 0
    assert _saves_tensor(saving) and not _saves_tensor(plain)


def test_sequence_numbers_grow_in_creation_order_and_the_walk_stops_at_the_first_node() -> None:
    x = torch.randn(3, requires_grad=True)
    first = _SavesNothing.apply(x)
    after_add = first + 1  # saves nothing
    after_mul = first * first  # saves its inputs
    assert first.grad_fn._sequence_nr() < after_add.grad_fn._sequence_nr() < after_mul.grad_fn._sequence_nr()
    assert all(isinstance(n, tuple) and len(n) == 2 for n in after_mul.grad_fn.next_functions)
    assert _nothing_saved_after(after_add, first.grad_fn)
    assert not _nothing_saved_after(after_mul, first.grad_fn)
