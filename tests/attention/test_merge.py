"""The log-sum-exp merge: the PyTorch path against float64, the Triton path against the PyTorch path."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_wallfacer.attention.merge import merge_, merge_torch_, triton_merge_available
from tests.attention.merge_cases import INF, assert_same_merge, merge_case

ROOT = Path(__file__).resolve().parents[2]


def _float64_merge(acc, acc_lse, out, lse):
    acc, acc_lse, out, lse = (x.double() for x in (acc, acc_lse, out, lse))
    new = torch.logaddexp(acc_lse, lse)
    w_a = torch.where(torch.isinf(acc_lse), 0.0, torch.exp(acc_lse - new))
    w_b = torch.where(torch.isinf(lse), 0.0, torch.exp(lse - new))
    return acc * w_a.unsqueeze(-1) + out * w_b.unsqueeze(-1), new


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_torch_merge_matches_float64_on_a_strided_view(out_dtype):
    acc, acc_lse, out, lse = merge_case(out_dtype=out_dtype)
    want_out, want_lse = _float64_merge(acc[:, :, 8:48], acc_lse[:, :, 8:48], out, lse)
    untouched = acc[:, :, :8].clone(), acc[:, :, 48:].clone()
    view_out, view_lse = acc[:, :, 8:48], acc_lse[:, :, 8:48]
    assert not view_out.is_contiguous()
    merge_(view_out, view_lse, out, lse)  # on CPU: the PyTorch path
    assert_same_merge(view_out, want_out, view_lse, want_lse, 1e-5)
    assert torch.equal(acc[:, :, :8], untouched[0]) and torch.equal(acc[:, :, 48:], untouched[1])
    assert (view_out[0, 1, 4:8] == 0).all() and torch.isinf(view_lse[0, 1, 4:8]).all()  # neither: stays (0, -inf)
    torch.testing.assert_close(view_out[0, 1, :4], out[0, 1, :4].float())  # first block seen: taken as it is


def test_merging_blocks_one_by_one_equals_attention_over_their_union():
    """Two key blocks merged equal one softmax over both (what ring attention relies on)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    s = q @ k.transpose(-1, -2)
    full = torch.softmax(s, -1) @ v
    acc = torch.zeros(1, 2, 16, 8)
    acc_lse = torch.full((1, 2, 16), INF)
    for part in (slice(0, 5), slice(5, 16)):
        sb = s[..., part]
        merge_torch_(acc, acc_lse, (torch.softmax(sb, -1) @ v[:, :, part]).float(), torch.logsumexp(sb, -1).float())
    torch.testing.assert_close(acc.double(), full, atol=1e-6, rtol=0)
    torch.testing.assert_close(acc_lse.double(), torch.logsumexp(s, -1), atol=1e-5, rtol=0)


@pytest.mark.skipif(not triton_merge_available(), reason="needs CUDA and Triton")
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_triton_merge_equals_torch_merge(out_dtype):
    from ds_wallfacer.attention.merge import _qualifies

    acc, acc_lse, out, lse = merge_case(out_dtype=out_dtype, device="cuda")
    a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()
    assert _qualifies(a1[:, :, 8:48], l1[:, :, 8:48], out, lse)
    merge_(a1[:, :, 8:48], l1[:, :, 8:48], out, lse)  # Triton
    merge_torch_(a2[:, :, 8:48], l2[:, :, 8:48], out, lse)
    assert_same_merge(a1, a2, l1, l2, 1e-5)


def test_triton_merge_kernel_in_the_triton_interpreter():
    """The Triton kernel's logic, run by Triton's CPU interpreter where Triton is installed (GPU machines)."""
    pytest.importorskip("triton")
    code = (
        "import torch\n"
        "from ds_wallfacer.attention.merge import merge_triton_, merge_torch_\n"
        "from tests.attention.merge_cases import assert_same_merge, merge_case\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    acc, acc_lse, out, lse = merge_case(out_dtype=dt)\n"
        "    a1, l1, a2, l2 = acc.clone(), acc_lse.clone(), acc.clone(), acc_lse.clone()\n"
        "    merge_triton_(a1[:, :, 8:48], l1[:, :, 8:48], out, lse)\n"
        "    merge_torch_(a2[:, :, 8:48], l2[:, :, 8:48], out, lse)\n"
        "    assert_same_merge(a1, a2, l1, l2, 1e-5)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]))
    res = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
