"""The lean paths of MsT (Note [Lean LM head] in ``mst/lm_head.py``, Note [Lean MLP backward] in ``mst/mlp.py``):
the in-place logits gradient against autograd through ``F.cross_entropy`` for every head transform, ignored rows
and chunk splits; the gradient sums handed to autograd exactly once; the MLP's hooked accumulation with parameters
that already have, or do not have, a ``.grad``."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_wallfacer.mst import chunked_linear_cross_entropy, mini_sequence_mlp

TOL = dict(rtol=1e-5, atol=1e-6)


def _reference(x, y, w, b, *, scale=None, divisor=None, softcap=None):
    z = F.linear(x, w, b).float()
    if scale is not None:
        z = z * scale
    if divisor is not None:
        z = z / divisor
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z.flatten(0, -2), y.flatten(), ignore_index=-100, reduction="sum")


@pytest.mark.parametrize("transform", [{}, {"scale": 0.7}, {"divisor": 3.0}, {"softcap": 2.5},
                                       {"scale": 1.5, "divisor": 2.0, "softcap": 4.0}])
@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_in_place_logits_gradient_matches_autograd(transform: dict, chunk: int) -> None:
    gen = torch.Generator().manual_seed(chunk)
    x = torch.randn(2, 9, 16, generator=gen, requires_grad=True)
    w = torch.randn(33, 16, generator=gen, requires_grad=True)
    b = torch.randn(33, generator=gen, requires_grad=True)
    y = torch.randint(0, 33, (2, 9), generator=gen)
    y[0, :4] = -100  # rows without a target: no loss, no gradient
    s, c = chunked_linear_cross_entropy(x, y, w, b, chunk_tokens=chunk, **transform)
    (0.3 * s).backward()  # an upstream scale reaches every gradient, the in-place sums included
    got = [t.grad.clone() for t in (x, w, b)]
    for t in (x, w, b):
        t.grad = None
    ref = _reference(x, y, w, b, **transform)
    (0.3 * ref).backward()
    torch.testing.assert_close(s, ref, **TOL)
    assert c.item() == 14
    for g, t in zip(got, (x, w, b)):
        torch.testing.assert_close(g, t.grad, **TOL)


def test_no_target_at_all_gives_zero_loss_and_zero_gradients() -> None:
    x = torch.randn(6, 8, requires_grad=True)
    w = torch.randn(12, 8, requires_grad=True)
    s, c = chunked_linear_cross_entropy(x, torch.full((6,), -100), w, chunk_tokens=4)
    s.backward()
    assert s.item() == 0.0 and c.item() == 0
    assert x.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_head_sums_are_consumed_by_one_backward() -> None:
    x = torch.randn(5, 8, requires_grad=True)
    w = torch.randn(12, 8, requires_grad=True)
    s, _ = chunked_linear_cross_entropy(x, torch.randint(0, 12, (5,)), w, chunk_tokens=2)
    s.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        s.backward()


def test_no_grad_head_gives_the_loss_only() -> None:
    x, w = torch.randn(7, 8), torch.randn(12, 8)
    y = torch.randint(0, 12, (7,))
    s, c = chunked_linear_cross_entropy(x, y, w, chunk_tokens=3)
    torch.testing.assert_close(s, _reference(x, y, w, None), **TOL)
    assert s.grad_fn is None and c.item() == 7


@pytest.mark.parametrize("preset_grad", [False, True])
def test_mlp_sums_added_as_gradients_form(preset_grad: bool) -> None:
    """Three mini-sequences (one shorter): the hooked sums equal one full-sequence backward, whether the
    parameters' .grad is None (the first mini-sequence's gradient becomes the sum) or already holds a value; the
    hooks are gone afterwards."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(8, 24), nn.SiLU(), nn.Linear(24, 8))
    params = list(mlp.parameters())
    if preset_grad:
        for p in params:
            p.grad = torch.ones_like(p)
    x = torch.randn(1, 11, 8, requires_grad=True)
    g = torch.randn(1, 11, 8)
    mini_sequence_mlp(mlp.forward, x, params, chunk_tokens=4).backward(g)
    got = [x.grad.clone()] + [p.grad.clone() for p in params]
    x.grad = None
    for p in params:
        p.grad = torch.ones_like(p) if preset_grad else None
    mlp(x).backward(g)
    for a, b in zip(got, [x.grad] + [p.grad for p in params]):
        torch.testing.assert_close(a, b, **TOL)
    assert all(not p._backward_hooks for p in params)


def test_even_chunks_keep_the_count_and_shrink_the_largest() -> None:
    from ds_wallfacer.mst.mlp import even_chunk_tokens

    assert even_chunk_tokens(2048, 524) == 512  # 4 mini-sequences either way
    assert even_chunk_tokens(11, 4) == 4 and even_chunk_tokens(3, 8) == 3 and even_chunk_tokens(0, 8) == 1
    for n in range(1, 60):
        for c in range(1, 20):
            e = even_chunk_tokens(n, c)
            assert e <= c and -(-n // e) == -(-n // c), (n, c, e)
