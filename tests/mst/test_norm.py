"""Lean RMSNorm (``mst/norm.py``) against transformers' own RMSNorm classes: which forms are recognised, the forward
bitwise, the gradients, and what autograd keeps for the backward (counted with saved-tensor hooks)."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from ds_wallfacer.mst import apply_mini_sequence
from ds_wallfacer.mst.norm import chunk_rows, lean_rms_norm, norm_form

CLASSES = {"cast": LlamaRMSNorm, "promote": Olmo2RMSNorm, "fp32": NemotronHRMSNorm, "one-plus": Gemma2RMSNorm}
WIDTH = 48


def _norm(cls: type, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    m = cls(WIDTH).to(dtype)
    with torch.no_grad():
        m.weight.normal_()
    return m


@pytest.mark.parametrize("scale", sorted(CLASSES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_forward_and_gradients_as_transformers(scale: str, dtype: torch.dtype) -> None:
    m = _norm(CLASSES[scale], dtype)
    form = norm_form(m)
    assert form is not None and form.scale == scale
    x = torch.randn(3, 50, WIDTH, dtype=dtype, requires_grad=True)
    ref = m(x)
    g = torch.randn_like(ref)
    ref.backward(g)
    dx, dw = x.grad, m.weight.grad
    x.grad = m.weight.grad = None
    out = lean_rms_norm(x, m.weight, getattr(m, form.eps_attr), form, rows_per_chunk=7)  # 150 rows: a ragged tail
    out.backward(g)
    assert out.dtype == ref.dtype and torch.equal(out, ref)  # the same operations in the same order
    tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, dx, **tol)
    # the weight's gradient: a sum over rows in another order (fp32 over chunks, not one bf16 reduction)
    torch.testing.assert_close(m.weight.grad, dw, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=(2e-2 if dtype == torch.bfloat16 else 1e-5) * dw.abs().max().item())


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves for the backward while ``fn`` runs."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_saves_only_the_input_and_one_factor_per_row() -> None:
    m = _norm(LlamaRMSNorm, torch.bfloat16)
    rows = 4096
    x = torch.randn(1, rows, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    hf = _saved_bytes(lambda: m(x))
    form = norm_form(m)
    lean = _saved_bytes(lambda: lean_rms_norm(x, m.weight, m.variance_epsilon, form))
    layer_input = rows * WIDTH * 2
    assert lean == layer_input + rows * 4  # x (held by the layer anyway) + fp32 1/rms
    assert hf >= 3 * layer_input  # an fp32 copy of the input and the normalised rows; not the input itself


def test_chunk_rule() -> None:
    assert chunk_rows(10) == 1024 and chunk_rows(1 << 20) == (1 << 20) // 32


class _Tweaked(LlamaRMSNorm):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:  # another expression: not recognised
        return super().forward(hidden_states) * 2


def test_other_forms_are_left_alone() -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    assert norm_form(_Tweaked(WIDTH)) is None
    assert norm_form(Qwen3NextRMSNormGated(WIDTH)) is None
    assert norm_form(nn.LayerNorm(WIDTH)) is None
    m = LlamaRMSNorm(WIDTH)
    m.forward = lambda x: x  # someone else's instance forward
    assert norm_form(m) is None


def test_applied_to_every_norm_of_a_model_and_removed() -> None:
    from tests.models import tiny_model

    model = tiny_model("llama")
    handle = apply_mini_sequence(model, {"activation_checkpointing": "none"})
    norms = [n for n, m in model.named_modules() if isinstance(m, LlamaRMSNorm)]
    assert handle.norm_modules == norms and len(norms) == 2 * 2 + 1
    off = apply_mini_sequence(tiny_model("llama"), {"activation_checkpointing": "none", "norm": False})
    assert off.norm_modules == []
    handle.remove()
    assert not any("forward" in model.get_submodule(n).__dict__ for n in norms)


def test_fp32_weight_over_bf16_rows() -> None:
    """Weights kept in fp32 under 16-bit activations: the output and the input's gradient still bitwise."""
    m = _norm(LlamaRMSNorm, torch.float32)
    x = torch.randn(2, 40, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    ref = m(x)
    g = torch.randn_like(ref)
    ref.backward(g)
    dx, x.grad = x.grad, None
    out = lean_rms_norm(x, m.weight, m.variance_epsilon, norm_form(m), rows_per_chunk=16)
    out.backward(g)
    assert out.dtype == torch.float32 and torch.equal(out, ref) and torch.equal(x.grad, dx)
