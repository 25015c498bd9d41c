"""Block kernels against the plain-PyTorch reference and against torch autograd, in one process."""
import pytest
import torch
import torch.nn.functional as F

from ds_wallfacer.attention.kernels import KERNELS, get_kernel
from tests.tolerance import sum_tolerance

CPU_KERNELS = ["reference", "cpu_flash"]


def _inputs(hq, hk, sq, sk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    return mk(2, hq, sq, d), mk(2, hk, sk, d), mk(2, hk, sk, d), mk(2, hq, sq, d)


def _autograd_ref(q, k, v, do, causal, scale):
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    s = torch.matmul(q, k.repeat_interleave(q.shape[1] // k.shape[1], 1).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.matmul(torch.softmax(s, -1), v.repeat_interleave(q.shape[1] // k.shape[1], 1))
    o.backward(do.double())
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("name", CPU_KERNELS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hq,hk,d", [(4, 4, 64), (8, 2, 128), (4, 1, 64)])
def test_kernel_matches_autograd_fp32(name, causal, hq, hk, d):
    sq, sk = (24, 24) if causal else (16, 40)
    q, k, v, do = _inputs(hq, hk, sq, sk, d, torch.float32)
    scale = 0.7 / d**0.5
    kern = get_kernel(name, q)
    out, lse = kern.forward(q, k, v, causal=causal, scale=scale)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = _autograd_ref(q, k, v, do, causal, scale)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, hq, sq)
    # fp32 against float64: the logits' dot products (d terms), then sums over the keys (forward, dq) or over the
    # query rows of each key's head group (dk, dv)
    fwd, bwd = d + sk, d + max(sk, sq * (hq // hk))
    torch.testing.assert_close(out.double(), o_ref, atol=sum_tolerance(fwd, o_ref), rtol=0)
    torch.testing.assert_close(lse.double(), lse_ref, atol=sum_tolerance(fwd, lse_ref), rtol=0)
    dq, dk, dv = kern.backward(do, q, k, v, out, lse, causal=causal, scale=scale)
    for got, want in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=sum_tolerance(bwd, want), rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_flash_low_precision_close_to_reference(dtype):
    q, k, v, do = _inputs(4, 2, 32, 32, 64, dtype)
    o_ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, enable_gqa=True)
    out, _ = get_kernel("cpu_flash", q).forward(q, k, v, causal=True, scale=64**-0.5)
    assert out.dtype == dtype
    assert (out.double() - o_ref).abs().max() < 2e-2


def test_registry_auto_and_errors():
    cpu = torch.zeros(1, 1, 2, 8)
    assert get_kernel("auto", cpu).name == "cpu_flash"
    assert set(KERNELS) == {"reference", "cpu_flash", "cuda_sdpa", "flash_attn", "cudnn", "flash_attn3", "flash_attn4"}
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        get_kernel("nope")
    with pytest.raises(ValueError, match="does not support"):
        get_kernel("cuda_sdpa", cpu)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_kernels_match_reference(dtype, causal):
    q, k, v, do = (x.cuda() for x in _inputs(8, 2, 256, 256, 128, dtype))
    ref = get_kernel("reference")
    o_ref, lse_ref = ref.forward(q, k, v, causal=causal, scale=128**-0.5)
    g_ref = ref.backward(do, q, k, v, o_ref, lse_ref, causal=causal, scale=128**-0.5)
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for name in ("cuda_sdpa", "flash_attn"):
        kern = KERNELS[name]()
        if not kern.supports(q):
            continue
        out, lse = kern.forward(q, k, v, causal=causal, scale=128**-0.5)
        torch.testing.assert_close(out.float(), o_ref.float(), atol=tol, rtol=0)
        torch.testing.assert_close(lse, lse_ref, atol=tol, rtol=0)
        for got, want in zip(kern.backward(do, q, k, v, out, lse, causal=causal, scale=128**-0.5), g_ref):
            torch.testing.assert_close(got.float(), want.float(), atol=5 * tol, rtol=0)


def _masked_ref(q, k, v, do, keep, softcap, scale):
    """float64 autograd: soft-capped logits, bool keep-mask; rows that see nothing give 0."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    s = torch.matmul(q, k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0).unsqueeze(-1))
    o = torch.matmul(p, v.repeat_interleave(rep, 1))
    o.backward(do.double())
    return o.detach(), lse.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("name,softcap", [("reference", 0.0), ("reference", 5.0), ("cpu_flash", 0.0)])
@pytest.mark.parametrize("causal", [True, False])
def test_kernel_mask_and_softcap(name, softcap, causal):
    """A sliding-window-like keep-mask with some rows that see no key at all, and soft-capped logits."""
    q, k, v, do = _inputs(4, 2, 20, 20, 32, torch.float32, seed=3)
    i = torch.arange(20)
    keep = ((i[:, None] - i[None, :]) < 6) & ((i[:, None] + i[None, :]) % 7 != 0)
    keep[4] = False  # a query with no visible key in this block
    keep = keep.expand(2, 1, 20, 20)
    full = keep & (torch.ones(20, 20, dtype=torch.bool).tril() if causal else True)
    kern = get_kernel(name, q, mask=True, softcap=bool(softcap))
    scale = 3.0 / 32**0.5  # large logits, so the cap matters
    out, lse = kern.forward(q, k, v, causal=causal, scale=scale, mask=keep, softcap=softcap)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = _masked_ref(q, k, v, do, full, softcap, scale)
    terms = 32 + 20 * 2  # d of the logits, then 20 keys (or 20 rows of 2 query heads per key head)
    seen = torch.isfinite(lse_ref)
    torch.testing.assert_close(out.double(), o_ref, atol=sum_tolerance(terms, o_ref), rtol=0)
    torch.testing.assert_close(lse.double()[seen], lse_ref[seen], atol=sum_tolerance(terms, lse_ref[seen]), rtol=0)
    assert torch.isinf(lse[:, :, 4]).all() and (out[:, :, 4] == 0).all()
    grads = kern.backward(do, q, k, v, out, lse, causal=causal, scale=scale, mask=keep, softcap=softcap)
    for got, want in zip(grads, (dq_ref, dk_ref, dv_ref)):
        torch.testing.assert_close(got.double(), want, atol=sum_tolerance(terms, want), rtol=0)


def test_kernel_without_softcap_is_refused_by_name():
    cpu = torch.zeros(1, 1, 2, 8)
    assert get_kernel("auto", cpu, softcap=True).name == "reference"
    assert get_kernel("auto", cpu, mask=True).name == "cpu_flash"
    with pytest.raises(ValueError, match="'cpu_flash' cannot apply attention logit soft-capping.*reference"):
        get_kernel("cpu_flash", cpu, softcap=True)
