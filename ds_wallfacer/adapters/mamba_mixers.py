"""Mamba-2 mixers (``Mamba2Mixer`` and the classes that copy it: Bamba, Granite 4 hybrid, Nemotron-H, Zamba2; and
Falcon-H1's, with its muP multipliers and optional norm) on sequence shards, head-parallel.

The mixer projects its input (position-wise) to a gate, x (H heads of hd), B and C (G groups of the state size N)
and dt (one per head); convolves x, B and C causally per channel; runs the selective state-space scan per head
(heads of one group share its B and C); normalises the result gated by the gate and projects it out. As for gated
delta-nets (``delta_nets.py``), one all-to-all gives each rank every token of H / P heads and of the groups they
read (when G < P each group goes to the P / G ranks whose heads read it: B and C are small next to x), the rank
runs the model's own convolution (its channels of the weight) and the model's own chunked scan, and a second
all-to-all returns the result. Packed rows run both per document, as each document trained alone. Attached by
``mixer_layers.py``.

Design: Note [Gated delta-nets and Mamba-2 on shards] in docs/design/mixers.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .mixer_shards import (CONV_HELPER, Form, causal_depthwise, conv_call, convolve_channels, family_misses,
                           first_family, head_parallel_call, per_document)

__all__ = ["SETTINGS", "form_misses", "head_counts", "is_mamba_mixer", "read_parameters", "sharded_forward"]

_CONV_SPLIT = (
    re.compile(r"\bA\s*=\s*-torch\.exp\(self\.A_log\.float\(\)\)"),
    re.compile(r"\bgate\s*,\s*hidden_states_B_C\s*,\s*dt\s*=\s*projected_states\.split\(\s*\[\s*self\.intermediate_size"
               r"\s*,\s*self\.conv_dim\s*,\s*self\.num_heads\s*\]\s*,\s*dim\s*=\s*-1"),
    re.compile(r"\bhidden_states\s*,\s*B\s*,\s*C\s*=\s*torch\.split\(\s*hidden_states_B_C\s*,\s*\[\s*self\."
               r"intermediate_size\s*,\s*self\.n_groups\s*\*\s*self\.ssm_state_size\s*,\s*self\.n_groups\s*\*\s*self\."
               r"ssm_state_size\s*\]"),
    re.compile(r"\bself\.out_proj\(scan_output\.to\(dtype\)\)"),
)
"""What every recognised mixer computes: the projection split into gate | x B C | dt, the split of x, B and C, the
output projection."""


def _scan_call(owner: str, heads: str, state: str, *, chunked: bool) -> re.Pattern:
    """The chunked scan's call (D skip and dt bias, softplus and limits inside it) on the whole sequence: by the
    mixer's forward (``owner`` ``self``, transformers <= 5.24) or by 5.25's helper ``mamba2_scan_forward``
    (``owner`` ``module``, its inputs named ``chunked_*``: without a cache, every token); ``heads`` / ``state`` the
    way the code writes the head count and the state size in its views."""
    o, c = owner + r"\.", "chunked_" if chunked else ""
    n = "effective_sequence_length" if chunked else "seq_len"
    final = r"cache\s+is\s+not\s+None" if chunked else "output_final_state"
    return re.compile(
        r"\bmamba2_chunk_scan\(\s*" + c + r"hidden_states\.view\(batch_size\s*,\s*" + n + r"\s*,\s*" + heads + r"\s*,\s*"
        + o + r"head_dim\)\s*,\s*" + c + r"dt\s*,\s*A\s*,\s*" + c + r"B\.view\(batch_size\s*,\s*" + n + r"\s*,\s*" + o
        + r"n_groups\s*,\s*" + state + r"\)\s*,\s*" + c + r"C\.view\(batch_size\s*,\s*" + n + r"\s*,\s*" + o
        + r"n_groups\s*,\s*" + state + r"\)\s*,\s*chunk_size\s*=\s*" + o + r"chunk_size\s*,\s*D\s*=\s*" + o
        + r"D\s*,\s*z\s*=\s*None\s*,\s*return_final_states\s*=\s*" + final + r"\s*,\s*dt_bias\s*=\s*" + o
        + r"dt_bias\s*,\s*dt_softplus\s*=\s*True\s*,\s*initial_states\s*=\s*recurrent_state\s*,\s*dt_limit\s*=\s*"
        + o + r"time_step_limit")


_SCAN_HELPER = ("mamba2_scan_forward", (
    re.compile(r"\bA\s*=\s*-torch\.exp\(module\.A_log\.float\(\)\)"),
    re.compile(r"\brecurrent_state\s*=\s*cache\.get_recurrent_state\([^)]*\)\s*if\s+cache\s+is\s+not\s+None\s+else\s+"
               r"None"),
    re.compile(r"\bcache\.get_recurrent_states_to_keep\(module\.layer_idx\)\s*if\s+cache\s+is\s+not\s+None\s+else\s+0\b"),
    _scan_call("module", r"module\.num_heads", r"module\.ssm_state_size", chunked=True),
))
"""transformers 5.25's ``mamba2_scan_forward`` without a cache: the chunked scan over every token."""

_CONV_KERNEL, _CONV_HELPER = conv_call("hidden_states_B_C", "conv1d", activation=True)


def _forms(old: tuple[re.Pattern, ...], new: tuple[re.Pattern, ...]) -> tuple[Form, ...]:
    """The mixer's expression as transformers <= 5.24 writes it (``old``: the convolution and the scan called in the
    forward) and as 5.25 does (``new``: both through the cache-aware helpers)."""
    scan = re.compile(r"\bscan_output\s*=\s*mamba2_scan_forward\(\s*self\s*,\s*hidden_states\s*,\s*B\s*,\s*C\s*,\s*dt\s*,"
                      r"\s*cache\b")
    return (Form(_CONV_SPLIT + (_CONV_KERNEL,) + old),
            Form(_CONV_SPLIT + (_CONV_HELPER, scan) + new, (CONV_HELPER, _SCAN_HELPER)))


def _mamba2_gate(m: nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return m.norm(y, gate)


def _falcon_h1_gate(m: nn.Module, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return m.norm(y, gate) if m.mamba_rms_norm else y * torch.nn.functional.silu(gate)


@dataclass(frozen=True)
class _Family:
    """One recognised form: its children and the expression of its forward, the factors on its input and on its
    projection (Falcon-H1's muP multipliers; None: none) and how it gates the scan's output."""

    children: frozenset[str]
    forms: tuple[Form, ...]
    input_scale: str | None
    projection_scale: str | None
    gate: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


_PROJECTION = re.compile(r"\bprojected_states\s*=\s*self\.in_proj\(hidden_states\)\s*(?:#[^\n]*\s*)*A\s*=")
_NORM = re.compile(r"\bscan_output\s*=\s*self\.norm\(scan_output\s*,\s*gate\)\s*(?:#[^\n]*\s*)*contextualized_states\s*="
                   r"\s*self\.out_proj\(")
"""Mamba-2's projection of the input as it is and its gated norm right before the output projection (which tells it
from Falcon-H1's, with muP multipliers and an optional norm, now that both call the same helpers)."""
_FALCON = (re.compile(r"\bhidden_states\s*=\s*hidden_states\s*\*\s*self\.ssm_in_multiplier"),
           re.compile(r"\bprojected_states\s*=\s*self\.in_proj\(hidden_states\)\s*projected_states\s*=\s*"
                      r"projected_states\s*\*\s*self\.mup_vector"),
           re.compile(r"\bif\s+self\.mamba_rms_norm\s*:\s*scan_output\s*=\s*self\.norm\(scan_output\s*,\s*gate\)\s*"
                      r"else\s*:\s*scan_output\s*=\s*scan_output\s*\*\s*torch\.nn\.functional\.silu\(gate\)"))

_FAMILIES = (
    _Family(frozenset({"conv1d", "in_proj", "norm", "out_proj"}),
            _forms((_PROJECTION, _scan_call("self", r"self\.num_heads", r"self\.ssm_state_size", chunked=False), _NORM),
                   (_PROJECTION, _NORM)), None, None, _mamba2_gate),
    _Family(frozenset({"conv1d", "in_proj", "norm", "out_proj"}),  # Falcon-H1 (norm: gated RMSNorm or Identity)
            _forms(_FALCON + (_scan_call("self", "-1", "-1", chunked=False),), _FALCON),
            "ssm_in_multiplier", "mup_vector", _falcon_h1_gate),
)


_NEEDED = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim", "chunk_size",
           "time_step_limit", "activation")


def _built_like(m: nn.Module) -> list[_Family]:
    """The families whose parts ``m`` has: the attributes and sizes, a depthwise causal convolution over x, B and C,
    the own parameters and the children (the expression of the forward aside)."""
    if not all(hasattr(m, a) for a in _NEEDED) or not causal_depthwise(getattr(m, "conv1d", None)):
        return []
    if not (m.conv1d.in_channels == m.conv_dim == m.intermediate_size + 2 * m.n_groups * m.ssm_state_size
            and m.intermediate_size == m.num_heads * m.head_dim):
        return []
    if {n for n, _ in m.named_parameters(recurse=False)} != {"dt_bias", "A_log", "D"}:
        return []
    children = {n for n, _ in m.named_children()} - {"act"}
    return [f for f in _FAMILIES if children == f.children]


def form_misses(m: nn.Module) -> tuple[str, ...] | None:
    """None: ``m`` is not built like a Mamba-2 mixer; (): it is one of a recognised form; else what its forward
    misses of the closest form (``mixer_shards.form_misses``)."""
    return family_misses(type(m), _built_like(m))


def is_mamba_mixer(m: nn.Module) -> bool:
    """Whether ``m`` is a Mamba-2 mixer of the recognised form."""
    return form_misses(m) == ()


def read_parameters(m: nn.Module) -> list[nn.Parameter]:
    """The parameters the forward reads without calling their module (the convolution's)."""
    return list(m.conv1d.parameters())


def head_counts(m: nn.Module) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(heads,), (groups,): the heads divide by P and the groups divide P or by it (each rank scans whole heads and
    holds the groups they read)."""
    return (int(m.num_heads),), (int(m.n_groups),)


SETTINGS = "the mixer's heads (num_heads / mamba_n_heads) and n_groups"
"""What ``head_counts`` reads, for the message when P does not split it."""


def sharded_forward(self: nn.Module, hidden_states: torch.Tensor, cache: Any = None,
                    attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor:
    """The mixer's forward on this rank's shard (hidden_states [B, S_l, D])."""
    call = head_parallel_call(self, cache, attention_mask)
    model_code, runs, p, j = call.model_code, call.runs, call.p, call.j
    b, s, _ = hidden_states.shape
    dtype = hidden_states.dtype
    h, hd, g, n_state, inter = self.num_heads, self.head_dim, self.n_groups, self.ssm_state_size, self.intermediate_size
    rep = max(p // g, 1)  # ranks per group when G < P
    family = first_family(type(self), _built_like(self))
    a_all = -torch.exp(self.A_log.float())
    if family.input_scale is not None:
        hidden_states = hidden_states * getattr(self, family.input_scale)
    projected = self.in_proj(hidden_states)
    if family.projection_scale is not None:
        projected = projected * getattr(self, family.projection_scale)
    gate, xbc, dt = projected.split([inter, self.conv_dim, h], dim=-1)
    x, bm, cm = xbc.split([inter, g * n_state, g * n_state], dim=-1)
    bm, cm = (t.reshape(b, s, g, n_state).repeat_interleave(rep, dim=2) for t in (bm, cm))  # [B, S_l, max(G, P), N]
    x, bm, cm, dt = call.gather([x.reshape(b, s, h, hd), bm, cm, dt[..., None]])
    n = x.shape[1]
    # this rank's channels of the convolution: x of its heads, B and C of the groups they read
    xs, gl = inter // p, max(g // p, 1)
    g0 = j * g // p if g >= p else j // rep
    mixed = convolve_channels(self, model_code, torch.cat([x.flatten(2), bm.flatten(2), cm.flatten(2)], dim=-1),
                              [(j * xs, (j + 1) * xs), (inter + g0 * n_state, inter + (g0 + gl) * n_state),
                               (inter + (g + g0) * n_state, inter + (g + g0 + gl) * n_state)], runs)
    x, bm, cm = mixed.split([xs, gl * n_state, gl * n_state], dim=-1)
    heads = slice(j * (h // p), (j + 1) * (h // p))

    def scan(x_, dt_, b_, c_):
        return model_code.mamba2_chunk_scan(
            x_, dt_, a_all[heads], b_, c_, chunk_size=self.chunk_size, D=self.D[heads], z=None,
            return_final_states=False, dt_bias=self.dt_bias[heads], dt_softplus=True, initial_states=None,
            dt_limit=self.time_step_limit)

    y = per_document(scan, runs, 1, x.reshape(b, n, h // p, hd), dt[..., 0], bm.reshape(b, n, gl, n_state),
                     cm.reshape(b, n, gl, n_state))  # [B, N, H / P, hd]
    y = call.scatter(y)
    y = family.gate(self, y.reshape(b, s, inter), gate)
    return self.out_proj(y.to(dtype))
