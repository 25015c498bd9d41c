"""The CUDA block-kernel backends (cuDNN, FlashAttention-3, flash-attn-4, flash-attn 2): registry and refusals,
their calling code against stand-in libraries on CPU, and (CUDA only) parity with the reference kernel.

The stand-ins take the exact parameter lists of real releases (read from their sources; the cuDNN one is checked
against this torch build's op schema) and compute with plain PyTorch in the library's layout, so the CPU tests
check what a backend sends (names, layouts, return positions, lse shapes, masks as biases), not the GPU kernels.
"""
import inspect
import sys
import types
from typing import Optional

import pytest
import torch

from ds_wallfacer.attention.kernel_names import AUTO_ORDER, KERNEL_NAMES
from ds_wallfacer.attention.kernels import KERNELS, get_kernel
from ds_wallfacer.attention.kernels import cudnn as cudnn_mod
from ds_wallfacer.attention.kernels import flash_attn3 as fa3_mod
from ds_wallfacer.attention.kernels import flash_attn4 as fa4_mod
from ds_wallfacer.attention.kernels._signature import Signature
from ds_wallfacer.attention.kernels.reference import ReferenceKernel

CUDA_KERNELS = ("cudnn", "flash_attn3", "flash_attn4", "flash_attn")
REF = ReferenceKernel()


def _inputs(hq=8, hk=2, s=24, d=32, dtype=torch.float64, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *sh: torch.randn(*sh, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)  # noqa: E731
    return mk(2, hq, s, d), mk(2, hk, s, d), mk(2, hk, s, d), mk(2, hq, s, d)


def _keep(s: int, device="cpu") -> torch.Tensor:
    """A sliding-window keep-mask [1, 1, s, s] with a query row (4) that sees no key."""
    i = torch.arange(s, device=device)
    keep = (i[:, None] - i[None, :]).abs() < 6
    keep[4] = False
    return keep.expand(1, 1, s, s)


# -- registry ------------------------------------------------------------------------------------------------


def test_registry_names_order_and_cpu_choice():
    assert tuple(KERNELS) == KERNEL_NAMES and sorted(AUTO_ORDER) == sorted(KERNEL_NAMES)
    assert AUTO_ORDER[-2:] == ("cpu_flash", "reference")
    assert AUTO_ORDER.index("cudnn") < AUTO_ORDER.index("flash_attn") < AUTO_ORDER.index("cuda_sdpa")
    cpu = torch.zeros(1, 1, 2, 8)
    assert get_kernel("auto", cpu).name == "cpu_flash"
    assert get_kernel("auto", cpu, mask=True).name == "cpu_flash"
    assert get_kernel("auto", cpu, softcap=True).name == "reference"
    for name in CUDA_KERNELS:
        assert not KERNELS[name]().supports(cpu) and not KERNELS[name]().supports(cpu.bfloat16())


@pytest.mark.parametrize("name,hint", [
    ("cudnn", "head dim <= 128"), ("flash_attn3", "Hopper"), ("flash_attn4", "flash-attn-4"),
    ("flash_attn", "pip install 'ds_wallfacer[flash]'"),
])
def test_cuda_backends_refuse_cpu_tensors_by_name(name, hint):
    with pytest.raises(ValueError, match=f"attention kernel '{name}' does not support torch.float32 tensors on cpu"
                                         r" \(head dim 8\)") as e:
        get_kernel(name, torch.zeros(1, 1, 2, 8))
    assert hint in str(e.value)


def test_capabilities_and_refusals_name_the_kernels_that_can():
    caps = {n: (KERNELS[n].supports_mask, KERNELS[n].supports_softcap) for n in KERNELS}
    assert caps["cudnn"] == (True, False)
    assert caps["flash_attn3"] == caps["flash_attn4"] == caps["flash_attn"] == (False, True)
    with pytest.raises(ValueError, match="'cudnn' cannot apply attention logit soft-capping") as e:
        get_kernel("cudnn", softcap=True)
    for able in ("reference", "flash_attn", "flash_attn3", "flash_attn4"):
        assert repr(able) in str(e.value)
    with pytest.raises(ValueError, match="'flash_attn3' cannot apply a sliding-window mask") as e:
        get_kernel("flash_attn3", mask=True)
    assert "'cudnn'" in str(e.value) and "'flash_attn4'" not in str(e.value)


def test_signature_reads_through_torch_custom_ops():
    @torch.library.custom_op("wf_test_sig::f", mutates_args=())
    def f(q: torch.Tensor, causal: bool, softcap: float = 0.0) -> torch.Tensor:
        return q * (2.0 if causal else 1.0) + softcap

    assert str(inspect.signature(f)) == "(*args, **kwargs)"  # what a naive probe would see
    sig = Signature(f)
    assert sig.names == {"q", "causal", "softcap"} and sig.required == ("q", "causal")
    assert sig.call(q=torch.ones(2), causal=True, window_size=(-1, -1)).tolist() == [2.0, 2.0]


# -- stand-in libraries ------------------------------------------------------------------------------------------


def _bshd(x):
    return x.transpose(1, 2)


def _ref_fwd_bshd(q, k, v, scale, causal, softcap):
    out, lse = REF.forward(_bshd(q), _bshd(k), _bshd(v), causal=causal, scale=scale, softcap=softcap or 0.0)
    return _bshd(out).contiguous(), lse


def _ref_bwd_bshd(dout, q, k, v, out, lse, scale, causal, softcap):
    grads = REF.backward(_bshd(dout), _bshd(q), _bshd(k), _bshd(v), _bshd(out), lse, causal=causal, scale=scale,
                         softcap=softcap or 0.0)
    return [_bshd(g).to(q.dtype) for g in grads]


def _fa2_v26():
    """flash-attn 2.6.3: window_size as a pair; the forward returns (out, q, k, v, out_padded, lse, S_dmask, rng)."""
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        assert dropout_p == 0.0 and tuple(window_size) == (-1, -1) and alibi_slopes is None and not return_softmax
        out, lse = _ref_fwd_bshd(q, k, v, softmax_scale, causal, softcap)
        return out, q, k, v, out, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        for buf, g in zip((dq, dk, dv), _ref_bwd_bshd(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softcap)):
            buf.copy_(g)
        return dq, dk, dv, None

    return _flash_attn_forward, _flash_attn_backward


def _fa2_v28():
    """flash-attn 2.8.3: torch custom ops, split window sizes, (out, lse, S_dmask, rng); backward fills dq/dk/dv."""
    @torch.library.custom_op("wf_test_fa2::fwd", mutates_args=())
    def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                            softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                            softcap: float, alibi_slopes: Optional[torch.Tensor], return_softmax: bool
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        assert (window_size_left, window_size_right) == (-1, -1)
        out, lse = _ref_fwd_bshd(q, k, v, softmax_scale, causal, softcap)
        return out, lse, torch.empty(0), torch.empty(2)

    @torch.library.custom_op("wf_test_fa2::bwd", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, softmax_lse: torch.Tensor, dq: Optional[torch.Tensor],
                             dk: Optional[torch.Tensor], dv: Optional[torch.Tensor], dropout_p: float,
                             softmax_scale: float, causal: bool, window_size_left: int, window_size_right: int,
                             softcap: float, alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                             rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
        for buf, g in zip((dq, dk, dv), _ref_bwd_bshd(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softcap)):
            buf.copy_(g)
        return torch.empty(0)

    return _flash_attn_forward, _flash_attn_backward


def _fa3_2025():
    """FlashAttention-3, spring 2025: optional tensors without defaults, window_size pair, ``causal`` in both."""
    def _flash_attn_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new,
                            seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k,
                            rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale,
                            causal, window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
                            scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0):
        assert cu_seqlens_q is None and page_table is None and out is None and tuple(window_size) == (-1, -1)
        o, lse = _ref_fwd_bshd(q, k, v, softmax_scale, causal, softcap)
        return o, lse, None, None

    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
                             max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
                             softcap=0.0, deterministic=False, sm_margin=0):
        assert cu_seqlens_q is None
        for buf, g in zip((dq, dk, dv), _ref_bwd_bshd(dout, q, k, v, out, softmax_lse, softmax_scale, causal, softcap)):
            buf.copy_(g)
        return dq, dk, dv, None

    return _flash_attn_forward, _flash_attn_backward


def _fa3_2026():
    """FlashAttention-3, 2026: torch custom ops, split window sizes, ``is_causal`` in the backward."""
    T = Optional[torch.Tensor]

    @torch.library.custom_op("wf_test_fa3::fwd", mutates_args=())
    def _flash_attn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: T = None, v_new: T = None,
                            qv: T = None, out_: T = None, cu_seqlens_q: T = None, cu_seqlens_k: T = None,
                            cu_seqlens_k_new: T = None, seqused_q: T = None, seqused_k: T = None,
                            max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None,
                            page_table: T = None, kv_batch_idx: T = None, leftpad_k: T = None, rotary_cos: T = None,
                            rotary_sin: T = None, seqlens_rotary: T = None, q_descale: T = None,
                            k_descale: T = None, v_descale: T = None, softmax_scale: Optional[float] = None,
                            causal: bool = False, window_size_left: int = -1, window_size_right: int = -1,
                            attention_chunk: int = 0, softcap: float = 0.0, rotary_interleaved: bool = True,
                            scheduler_metadata: T = None, num_splits: int = 1, pack_gqa: Optional[bool] = None,
                            sm_margin: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        o, lse = _ref_fwd_bshd(q, k, v, softmax_scale, causal, softcap)
        return o, lse, torch.empty(0), torch.empty(0)

    @torch.library.custom_op("wf_test_fa3::bwd", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, softmax_lse: torch.Tensor, cu_seqlens_q: T = None,
                             cu_seqlens_k: T = None, sequed_q: T = None, sequed_k: T = None,
                             max_seqlen_q: Optional[int] = None, max_seqlen_k: Optional[int] = None, dq: T = None,
                             dk: T = None, dv: T = None, softmax_scale: Optional[float] = None,
                             is_causal: bool = False, window_size_left: int = -1, window_size_right: int = -1,
                             softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0) -> torch.Tensor:
        for buf, g in zip((dq, dk, dv), _ref_bwd_bshd(dout, q, k, v, out, softmax_lse, softmax_scale, is_causal,
                                                       softcap)):
            buf.copy_(g)
        return torch.empty(0)

    return _flash_attn_forward, _flash_attn_backward


def _fa4():
    """flash-attn-4 (2026): softcap None = off in the forward; (out, lse, p, row_max); backward returns grads."""
    def _flash_attn_fwd(q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None,
                        max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None,
                        causal=False, softcap=None, window_size_left=None, window_size_right=None,
                        learnable_sink=None, tile_mn=None, num_threads=384, num_splits=1, pack_gqa=None,
                        return_lse=False, out=None, lse=None):
        assert softcap is None or softcap > 0, "0.0 would be a cap of zero"
        o, l = _ref_fwd_bshd(q, k, v, softmax_scale, causal, softcap)
        return o, (l if return_lse else None), None, None

    def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0,
                        window_size_left=None, window_size_right=None, m_block_size=64, n_block_size=128,
                        num_threads=256, pack_gqa=False, deterministic=False, dq=None, dk=None, dv=None):
        return tuple(_ref_bwd_bshd(dout, q, k, v, out, lse, softmax_scale, causal, softcap))

    return _flash_attn_fwd, _flash_attn_bwd


def _install(monkeypatch, module: str, **fns) -> None:
    parts = module.split(".")
    for i in range(1, len(parts)):
        monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    monkeypatch.setitem(sys.modules, module, types.SimpleNamespace(**fns))


@pytest.fixture
def fresh_probes():
    fa3_mod._functions.cache_clear()
    fa4_mod._functions.cache_clear()
    yield
    fa3_mod._functions.cache_clear()
    fa4_mod._functions.cache_clear()


STAND_INS = {
    "flash_attn-2.6": ("flash_attn", "flash_attn.flash_attn_interface", _fa2_v26, ("_flash_attn_forward", "_flash_attn_backward")),
    "flash_attn-2.8": ("flash_attn", "flash_attn.flash_attn_interface", _fa2_v28, ("_flash_attn_forward", "_flash_attn_backward")),
    "flash_attn3-2025": ("flash_attn3", "flash_attn_interface", _fa3_2025, ("_flash_attn_forward", "_flash_attn_backward")),
    "flash_attn3-2026": ("flash_attn3", "flash_attn_interface", _fa3_2026, ("_flash_attn_forward", "_flash_attn_backward")),
    "flash_attn4": ("flash_attn4", "flash_attn.cute.interface", _fa4, ("_flash_attn_fwd", "_flash_attn_bwd")),
}
_MADE: dict = {}  # custom ops register once per process


@pytest.mark.parametrize("release", list(STAND_INS))
@pytest.mark.parametrize("causal,softcap", [(True, 0.0), (False, 0.0), (True, 4.0)])
def test_flash_backends_drive_stand_in_releases(monkeypatch, fresh_probes, release, causal, softcap):
    name, module, make, names = STAND_INS[release]
    if release not in _MADE:
        _MADE[release] = make()
    _install(monkeypatch, module, **dict(zip(names, _MADE[release])))
    q, k, v, do = _inputs()
    scale = 1.5 / 32**0.5
    kern = KERNELS[name]()
    out, lse = kern.forward(q, k, v, causal=causal, scale=scale, softcap=softcap)
    o_ref, l_ref = REF.forward(q, k, v, causal=causal, scale=scale, softcap=softcap)
    assert out.shape == q.shape and lse.shape == (2, 8, 24) and lse.dtype == torch.float32 and lse.is_contiguous()
    torch.testing.assert_close(out, o_ref)
    torch.testing.assert_close(lse, l_ref)
    grads = kern.backward(do, q, k, v, out, lse, causal=causal, scale=scale, softcap=softcap)
    for got, want in zip(grads, REF.backward(do, q, k, v, o_ref, l_ref, causal=causal, scale=scale, softcap=softcap)):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.to(got.dtype))


def test_old_releases_are_declined_not_guessed(monkeypatch, fresh_probes):
    """FlashAttention-3's 2024 beta and flash-attn-4 without return_lse: no backend functions, so no support."""
    _install(monkeypatch, "flash_attn_interface", _flash_attn_forward=lambda q, k, v, softmax_scale, causal: None,
             _flash_attn_backward=lambda dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal: None)
    _install(monkeypatch, "flash_attn.cute.interface", _flash_attn_fwd=lambda q, k, v, softmax_scale=None: None,
             _flash_attn_bwd=lambda q, k, v, out, dout, lse: None)
    assert fa3_mod._functions() is None and fa4_mod._functions() is None
    with pytest.raises(RuntimeError, match="needs FlashAttention-3"):
        KERNELS["flash_attn3"]().forward(*_inputs()[:3], causal=True, scale=1.0)


# -- cuDNN against a stand-in op -------------------------------------------------------------------------------


def _cudnn_scores(query, key, attn_bias, is_causal, scale):
    assert query.shape[1] == key.shape[1], "the op is called with kv heads expanded"
    s = torch.matmul(query.double(), key.double().transpose(-1, -2)) * scale
    if attn_bias is not None:
        s = s + attn_bias.double()
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s


def _cudnn_op(lse_rank: int, lse_shift: float = 0.0):
    """A stand-in for the two aten ops (their schema's parameter names), computing as cuDNN does: additive bias,
    causal top-left; lse of rank ``lse_rank``, which its backward insists on (as autograd hands it over)."""
    def fwd(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
            return_debug_mask=False, *, scale=None):
        assert compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask
        s = _cudnn_scores(query, key, attn_bias, is_causal, scale)
        lse = torch.logsumexp(s, -1)
        out = torch.matmul(torch.softmax(s, -1), value.double()).to(query.dtype)
        lse = (lse + lse_shift).float()
        seed = torch.zeros((), dtype=torch.int64)
        return out, (lse.unsqueeze(-1) if lse_rank == 4 else lse), None, None, query.shape[2], key.shape[2], seed, seed, None

    def bwd(grad_out, query, key, value, out, logsumexp, philox_seed, philox_offset, attn_bias, cum_seq_q,
            cum_seq_k, max_q, max_k, dropout_p, is_causal, *, scale=None):
        assert logsumexp.dim() == lse_rank and cum_seq_q is None and (max_q, max_k) == (query.shape[2], key.shape[2])
        s = _cudnn_scores(query, key, attn_bias, is_causal, scale)
        p = torch.exp(s - logsumexp.double().reshape(s.shape[:-1]).unsqueeze(-1))
        do = grad_out.double()
        dv = p.transpose(-1, -2) @ do
        ds = p * (do @ value.double().transpose(-1, -2) - (do * out.double()).sum(-1, keepdim=True)) * scale
        return (ds @ key.double()).to(query.dtype), (ds.transpose(-1, -2) @ query.double()).to(key.dtype), dv.to(value.dtype)

    return types.SimpleNamespace(_scaled_dot_product_cudnn_attention=fwd, _scaled_dot_product_cudnn_attention_backward=bwd)


def test_cudnn_stand_in_takes_the_schema_of_this_torch_build():
    op = _cudnn_op(4)
    for name, fn in (("_scaled_dot_product_cudnn_attention", op._scaled_dot_product_cudnn_attention),
                     ("_scaled_dot_product_cudnn_attention_backward", op._scaled_dot_product_cudnn_attention_backward)):
        schema = getattr(torch.ops.aten, name).default._schema
        assert [a.name for a in schema.arguments] == list(inspect.signature(fn).parameters), name
    assert cudnn_mod.lse_rank() in (3, 4)  # this build's meta kernel, on CPU


@pytest.mark.parametrize("rank", [4, 3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_cudnn_backend_drives_a_stand_in_op(monkeypatch, rank, causal, masked):
    monkeypatch.setattr(cudnn_mod, "_aten", _cudnn_op(rank))
    monkeypatch.setattr(cudnn_mod, "_lse_rank", None)
    q, k, v, do = _inputs(s=20, seed=2)
    keep = _keep(20) if masked else None
    scale = 2.0 / 32**0.5
    kern = KERNELS["cudnn"]()
    out, lse = kern.forward(q, k, v, causal=causal, scale=scale, mask=keep)
    assert cudnn_mod.lse_rank() == rank
    o_ref, l_ref = REF.forward(q, k, v, causal=causal, scale=scale, mask=keep)
    torch.testing.assert_close(out, o_ref)
    assert torch.equal(torch.isinf(lse), torch.isinf(l_ref)) and lse.shape == (2, 8, 20)
    torch.testing.assert_close(lse[torch.isfinite(l_ref)], l_ref[torch.isfinite(l_ref)])
    if masked:
        assert (out[:, :, 4] == 0).all() and torch.isinf(lse[:, :, 4]).all()
    grads = kern.backward(do, q, k, v, out, lse, causal=causal, scale=scale, mask=keep)
    for got, want in zip(grads, REF.backward(do, q, k, v, o_ref, l_ref, causal=causal, scale=scale, mask=keep)):
        torch.testing.assert_close(got, want.to(got.dtype))


def test_cudnn_self_test_accepts_a_faithful_op_and_declines_a_wrong_lse(monkeypatch):
    monkeypatch.setattr(cudnn_mod, "_lse_rank", None)
    monkeypatch.setattr(cudnn_mod, "_aten", _cudnn_op(4))
    assert cudnn_mod._self_test(torch.device("cpu"), torch.float32, 64) == (True, True)
    monkeypatch.setattr(cudnn_mod, "_aten", _cudnn_op(4, lse_shift=0.6931))  # a log2-style lse would be off so
    with pytest.warns(UserWarning, match="disagrees with the reference kernel"):
        assert cudnn_mod._self_test(torch.device("cpu"), torch.float32, 64) == (False, False)


# -- CUDA: each backend against the float32 reference -----------------------------------------------------------


def _cuda_kernel(name: str, q: torch.Tensor):
    kern = KERNELS[name]()
    if not kern.supports(q):
        pytest.skip(f"{name} is not available for {q.dtype} on this GPU")
    return kern


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CUDA_KERNELS)
@pytest.mark.parametrize("dtype,causal,softcap", [  # few configurations: flash-attn-4 compiles each on first use
    (torch.bfloat16, True, 0.0), (torch.bfloat16, False, 0.0), (torch.bfloat16, True, 20.0),
    (torch.bfloat16, False, 20.0), (torch.float16, True, 0.0),
])
def test_cuda_backend_matches_float32_reference(name, dtype, causal, softcap):
    """bf16/fp16 kernel vs the float32 reference on the same (rounded) inputs, GQA 8/2, d = 128, 512 tokens:
    out and lse within 3e-2, gradients within 1.5e-1 (bf16 rounding of out and of the gradients themselves)."""
    q, k, v, do = _inputs(s=512, d=128, dtype=dtype, seed=5, device="cuda")
    kern = _cuda_kernel(name, q)
    if softcap and not kern.supports_softcap:
        pytest.skip(f"{name} has no soft-capping")
    scale = 128**-0.5 * (4.0 if softcap else 1.0)  # larger logits, so the cap matters
    f32 = [x.float() for x in (q, k, v, do)]
    o_ref, l_ref = REF.forward(*f32[:3], causal=causal, scale=scale, softcap=softcap)
    g_ref = REF.backward(f32[3], *f32[:3], o_ref, l_ref, causal=causal, scale=scale, softcap=softcap)
    out, lse = kern.forward(q, k, v, causal=causal, scale=scale, softcap=softcap)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 8, 512)
    torch.testing.assert_close(out.float(), o_ref, atol=3e-2, rtol=0)
    torch.testing.assert_close(lse, l_ref, atol=3e-2, rtol=0)
    for got, want in zip(kern.backward(do, q, k, v, out, lse, causal=causal, scale=scale, softcap=softcap), g_ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=1.5e-1, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_cudnn_mask_matches_float32_reference(causal):
    q, k, v, do = _inputs(s=256, d=128, dtype=torch.bfloat16, seed=6, device="cuda")
    kern = _cuda_kernel("cudnn", q)
    if not kern.supports_mask:
        pytest.fail("cuDNN's bias path failed its self-test on this GPU (see the warning)")
    keep = _keep(256, device="cuda")
    f32 = [x.float() for x in (q, k, v, do)]
    o_ref, l_ref = REF.forward(*f32[:3], causal=causal, scale=128**-0.5, mask=keep)
    g_ref = REF.backward(f32[3], *f32[:3], o_ref, l_ref, causal=causal, scale=128**-0.5, mask=keep)
    out, lse = kern.forward(q, k, v, causal=causal, scale=128**-0.5, mask=keep)
    torch.testing.assert_close(out.float(), o_ref, atol=3e-2, rtol=0)
    assert torch.equal(torch.isinf(lse), torch.isinf(l_ref)) and (out[:, :, 4] == 0).all()
    fin = torch.isfinite(l_ref)
    torch.testing.assert_close(lse[fin], l_ref[fin], atol=3e-2, rtol=0)
    for got, want in zip(kern.backward(do, q, k, v, out, lse, causal=causal, scale=128**-0.5, mask=keep), g_ref):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.float(), want, atol=1.5e-1, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_picks_a_fused_kernel():
    q = torch.zeros(1, 8, 128, 128, device="cuda", dtype=torch.bfloat16)
    chosen = get_kernel("auto", q).name
    assert chosen in AUTO_ORDER[:5], chosen
    assert get_kernel("auto", q, softcap=True).name in ("flash_attn3", "flash_attn4", "flash_attn", "reference")
    print(f"auto on {torch.cuda.get_device_name()}: {chosen}; with softcap: {get_kernel('auto', q, softcap=True).name}; "
          f"with a mask: {get_kernel('auto', q, mask=True).name}")
