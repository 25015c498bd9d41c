"""Gated delta-net layers (Qwen3-Next, Qwen3.5, OLMo-hybrid and the classes that copy them) on sequence shards,
head-parallel.

The layer projects its input (position-wise) to q, k, v (one "mixed" tensor), a gate z and the decay inputs b, a;
convolves q, k, v causally per channel; runs the gated delta rule, a recurrent scan, per value head; normalises
the result gated by z and projects it out. The scan carries a state along the whole sequence, so here one
all-to-all gives each rank every token of Hk / P key heads and Hv / P value heads (``mixers.gather_heads``); the
rank runs the model's own convolution (its channels of the weight) and the model's own scan on them, and a second
all-to-all returns the result to the shards. Packed rows run both per document, as each document trained alone.
Attached by ``mixer_layers.py``.

Design: Note [Gated delta-nets and Mamba-2 on shards] in docs/design/mixers.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .mixer_shards import (CONV_HELPER, Form, causal_depthwise, conv_call, convolve_channels, family_misses,
                           first_family, head_parallel_call, per_document)

__all__ = ["SETTINGS", "form_misses", "head_counts", "is_delta_net", "read_parameters", "sharded_forward"]

def _scan(prefix: str) -> re.Pattern:
    """The scan every recognised class runs (keys and queries l2-normalised in the kernel); transformers 5.25 names
    its decay and beta ``chunked_g`` / ``chunked_beta`` (``prefix``): the whole sequence without a cache."""
    return re.compile(r"\btorch_chunk_gated_delta_rule\(\s*\w+\s*,\s*\w+\s*,\s*\w+\s*,\s*g\s*=\s*" + prefix
                      + r"g\s*,\s*beta\s*=\s*" + prefix + r"beta\s*,\s*initial_state\s*=\s*recurrent_state\s*,\s*"
                      r"output_final_state\s*=\s*[\w ]+,\s*use_qk_l2norm_in_kernel\s*=\s*True")


_SCAN_FORMS = ((_scan(""),),
               (_scan("chunked_"), re.compile(r"\bcache\.get_recurrent_states_to_keep\(self\.layer_idx\)\s*if\s+cache"
                                              r"\s+is\s+not\s+None\s+else\s+0\b")))
"""The scan as transformers <= 5.24 and as 5.25 write it (5.25 keeps the last tokens' states only with a cache)."""

_QWEN_CORE = (
    re.compile(r"\bquery\s*,\s*key\s*,\s*value\s*=\s*torch\.split\(\s*mixed_qkv\s*,\s*\[\s*self\.key_dim\s*,\s*"
               r"self\.key_dim\s*,\s*self\.value_dim\s*,?\s*\]\s*,\s*dim\s*=\s*-1"),
    re.compile(r"\bbeta\s*=\s*b\.sigmoid\(\)"),
    re.compile(r"\bg\s*=\s*-self\.A_log\.float\(\)\.exp\(\)\s*\*\s*F\.softplus\(a\.float\(\)\s*\+\s*self\.dt_bias\)"),
    re.compile(r"\bself\.norm\(core_attn_out\s*,\s*z\)"),
    re.compile(r"\bself\.out_proj\(core_attn_out\)"),
)
"""What the Qwen classes compute after their projections: the split, the decay, the gated norm and the output
projection."""


def _qwen3_next_inputs(m: nn.Module, h: torch.Tensor):
    """Qwen3-Next: one projection for q, k, v, z, one for b, a, interleaved per key head."""
    q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(h), m.in_proj_ba(h))
    return q.flatten(2), k.flatten(2), v.flatten(2), z, b, a


def _qwen3_5_inputs(m: nn.Module, h: torch.Tensor):
    """Qwen3.5: separate projections for q | k | v, z, b and a."""
    q, k, v = m.in_proj_qkv(h).split([m.key_dim, m.key_dim, m.value_dim], dim=-1)
    z = m.in_proj_z(h)
    return q, k, v, z.reshape(*z.shape[:2], -1, m.head_v_dim), m.in_proj_b(h), m.in_proj_a(h)


def _olmo_hybrid_inputs(m: nn.Module, h: torch.Tensor):
    """OLMo-hybrid: one projection each for q, k, v, the gate, b and a."""
    z = m.g_proj(h)
    return m.q_proj(h), m.k_proj(h), m.v_proj(h), z.reshape(*z.shape[:2], -1, m.head_v_dim), m.b_proj(h), m.a_proj(h)


@dataclass(frozen=True)
class _Family:
    """One recognised form: its children, the expression of its forward (``_forms``), how it computes q, k, v, the
    gate z, b and a, the factor on beta (OLMo-hybrid's negative eigenvalues: 2) and the names of its gated norm and
    output."""

    children: frozenset[str]
    forms: tuple[Form, ...]
    inputs: Callable
    beta_scale: Callable[[nn.Module], float]
    norm: str
    out: str


def _forms(core: tuple[re.Pattern, ...], *, keywords: bool = False) -> tuple[Form, ...]:
    """``core`` with the convolution of q, k, v and the scan, as transformers <= 5.24 and as 5.25 write them."""
    kernel, helper = conv_call("mixed_qkv", "conv1d", activation=True, keywords=keywords)
    old, new = _SCAN_FORMS
    return Form(core + (kernel,) + old), Form(core + (helper,) + new, (CONV_HELPER,))


_QWEN3_NEXT = (
    re.compile(r"\bself\.fix_query_key_value_ordering\(\s*projected_states_qkvz\s*,\s*projected_states_ba\s*\)"),
    re.compile(r"\bprojected_states_qkvz\s*=\s*self\.in_proj_qkvz\(hidden_states\)"),
    re.compile(r"\bmixed_qkv\s*=\s*torch\.cat\(\(query\s*,\s*key\s*,\s*value\)\s*,\s*dim\s*=\s*-1\)"),
) + _QWEN_CORE
_QWEN3_5 = (
    re.compile(r"\bmixed_qkv\s*=\s*self\.in_proj_qkv\(hidden_states\)"),
    re.compile(r"\bz\s*=\s*self\.in_proj_z\(hidden_states\)"),
    re.compile(r"\bb\s*=\s*self\.in_proj_b\(hidden_states\)"),
    re.compile(r"\ba\s*=\s*self\.in_proj_a\(hidden_states\)"),
) + _QWEN_CORE
_OLMO_HYBRID = (
    re.compile(r"\bmixed_qkv\s*=\s*torch\.cat\(\s*\[\s*self\.q_proj\(hidden_states\)\s*,\s*self\.k_proj\("
               r"hidden_states\)\s*,\s*self\.v_proj\(hidden_states\)\s*,?\s*\]\s*,\s*dim\s*=\s*-1\s*,?\s*\)"),
    re.compile(r"\bq\s*,\s*k\s*,\s*v\s*=\s*torch\.split\(\s*mixed_qkv\.transpose\(1\s*,\s*2\)\s*,\s*"
               r"\[\s*self\.key_dim\s*,\s*self\.key_dim\s*,\s*self\.value_dim\s*,?\s*\]\s*,\s*dim\s*=\s*-1"),
    re.compile(r"\bbeta\s*=\s*self\.b_proj\(hidden_states\)\.sigmoid\(\)\s*if\s+self\.allow_neg_eigval\s*:\s*"
               r"beta\s*=\s*beta\s*\*\s*2\.0\b"),
    re.compile(r"\bg\s*=\s*-self\.A_log\.float\(\)\.exp\(\)\s*\*\s*F\.softplus\(self\.a_proj\(hidden_states\)"
               r"\.float\(\)\s*\+\s*self\.dt_bias\)"),
    re.compile(r"\bgate\s*=\s*self\.g_proj\(hidden_states\)"),
    re.compile(r"\boutput\s*=\s*self\.o_norm\(output\s*,\s*gate\)"),
    re.compile(r"\boutput\s*=\s*self\.o_proj\(output\)"),
)
"""Each family's expression besides the convolution and the scan (``_forms`` adds them)."""

_FAMILIES = (
    _Family(frozenset({"conv1d", "in_proj_qkvz", "in_proj_ba", "norm", "out_proj"}), _forms(_QWEN3_NEXT),
            _qwen3_next_inputs, lambda m: 1.0, "norm", "out_proj"),
    _Family(frozenset({"conv1d", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "norm", "out_proj"}),
            _forms(_QWEN3_5), _qwen3_5_inputs, lambda m: 1.0, "norm", "out_proj"),
    _Family(frozenset({"conv1d", "q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj", "o_norm", "o_proj"}),
            _forms(_OLMO_HYBRID, keywords=True), _olmo_hybrid_inputs, lambda m: 2.0 if m.allow_neg_eigval else 1.0,
            "o_norm", "o_proj"),
)
"""The recognised forms (Qwen3-Next, Qwen3.5, OLMo-hybrid)."""


def _built_like(m: nn.Module) -> list[_Family]:
    """The families whose parts ``m`` has: the attributes, a depthwise causal convolution over q, k, v, the own
    parameters and the children (the expression of the forward aside)."""
    needed = ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "activation")
    if not all(hasattr(m, a) for a in needed) or not causal_depthwise(getattr(m, "conv1d", None)):
        return []
    if m.conv1d.in_channels != 2 * m.key_dim + m.value_dim:
        return []
    if {n for n, _ in m.named_parameters(recurse=False)} != {"dt_bias", "A_log"}:
        return []
    children = {n for n, _ in m.named_children()}
    return [f for f in _FAMILIES if children == f.children]


def form_misses(m: nn.Module) -> tuple[str, ...] | None:
    """None: ``m`` is not built like a gated delta-net; (): it is one of a recognised form; else what its forward
    misses of the closest form (``mixer_shards.form_misses``)."""
    return family_misses(type(m), _built_like(m))


def is_delta_net(m: nn.Module) -> bool:
    """Whether ``m`` is a gated delta-net of a recognised form, with a depthwise causal convolution over q, k, v."""
    return form_misses(m) == ()


def read_parameters(m: nn.Module) -> list[nn.Parameter]:
    """The parameters the forward reads without calling their module (the convolution's)."""
    return list(m.conv1d.parameters())


def head_counts(m: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(key heads, value heads): both divide by P (each rank scans whole heads)."""
    return (int(m.num_k_heads), int(m.num_v_heads)), ()


SETTINGS = "linear_num_key_heads and linear_num_value_heads"
"""The config keys ``head_counts`` reads, for the message when P does not split them."""


def sharded_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                    attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The layer's forward on this rank's shard (hidden_states [B, S_l, D])."""
    call = head_parallel_call(self, cache, attention_mask)
    model_code, runs, p, j = call.model_code, call.runs, call.p, call.j
    b, s, _ = hidden_states.shape
    family = first_family(type(self), _built_like(self))
    q, k, v, z, beta_in, a = family.inputs(self, hidden_states)
    hk, hv, dk, dv = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
    q, k, v, beta_in, a = call.gather(
        [q.reshape(b, s, hk, dk), k.reshape(b, s, hk, dk), v.reshape(b, s, hv, dv), beta_in[..., None], a[..., None]])
    n = q.shape[1]
    # this rank's channels of the convolution: its key heads of q and of k, its value heads of v
    ks, vs, kd = self.key_dim // p, self.value_dim // p, self.key_dim
    mixed = convolve_channels(self, model_code, torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1),
                              [(j * ks, (j + 1) * ks), (kd + j * ks, kd + (j + 1) * ks),
                               (2 * kd + j * vs, 2 * kd + (j + 1) * vs)], runs)
    q, k, v = mixed.split([ks, ks, vs], dim=-1)
    q, k, v = q.reshape(b, n, hk // p, dk), k.reshape(b, n, hk // p, dk), v.reshape(b, n, hv // p, dv)
    heads = slice(j * (hv // p), (j + 1) * (hv // p))
    beta = beta_in[..., 0].sigmoid() * family.beta_scale(self)
    g = -self.A_log[heads].float().exp() * F.softplus(a[..., 0].float() + self.dt_bias[heads])

    def scan(q_, k_, v_, g_, beta_):
        return model_code.torch_chunk_gated_delta_rule(q_, k_, v_, g=g_, beta=beta_, initial_state=None,
                                                       output_final_state=False, use_qk_l2norm_in_kernel=True)[0]

    core = per_document(scan, runs, 1, q, k, v, g, beta)  # [B, N, Hv / P, dv]
    core = call.scatter(core)
    core = getattr(self, family.norm)(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(b, s, -1)
    return getattr(self, family.out)(core)
