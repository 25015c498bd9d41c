"""The router's auxiliary load-balancing loss of HF mixture-of-experts causal LMs under sequence parallelism.

Each rank sums its own per-token router statistics (``RouterAuxLoss.statistics``); the loss module adds them over
the sequence-parallel group together with the LM loss, and ``combine`` forms the aux loss from the global means
exactly as the model does.

Design: Note [Router aux loss across ranks] in docs/design/layouts.md (why global means, which tokens count).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from ..hf_config import text_config

__all__ = ["RouterAuxLoss", "router_aux_loss"]

_COEF_ATTRS = ("router_aux_loss_coef", "aux_loss_coef")
_Z_LOSS_KEYS = ("router_z_loss_coef", "z_loss_coef", "router_z_loss")


@dataclass(frozen=True)
class RouterAuxLoss:
    """How one model forms its auxiliary loss: ``coef * num_experts * sum_e f_e p_e``."""

    num_experts: int
    top_k: int
    coef: float

    @property
    def width(self) -> int:
        """Length of the statistics vector: tokens per expert [E], router probability sums [E], rows [1]."""
        return 2 * self.num_experts + 1

    def statistics(
        self, router_logits: Sequence[torch.Tensor], token_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """[2E + 1] fp32 sums over this rank's tokens and all layers (differentiable in the router probabilities).

        ``router_logits``: one [T, E] tensor per MoE layer (T = batch x local tokens, row-major like the model's
        ``reshape(-1, d)``); ``token_mask`` [B, S_l] (1 = counted) or None for all tokens.
        """
        if not router_logits:
            raise ValueError("the MoE model returned no router logits although output_router_logits is on")
        dev = router_logits[0].device
        e = self.num_experts
        tokens = torch.zeros(e, dtype=torch.float32, device=dev)
        probs = torch.zeros(e, dtype=torch.float32, device=dev)
        rows = torch.zeros(1, dtype=torch.float32, device=dev)
        for layer in router_logits:
            w = torch.softmax(layer.to(dev), dim=-1)  # [T, E], same op order as the model's loss
            _, chosen = torch.topk(w, self.top_k, dim=-1)  # [T, k]
            if token_mask is None:
                m = torch.ones(w.shape[0], dtype=torch.float32, device=dev)
            else:
                m = token_mask.reshape(-1).to(device=dev, dtype=torch.float32)  # [T]
                if m.shape[0] != w.shape[0]:
                    raise ValueError(f"router logits have {w.shape[0]} rows but the token mask {m.shape[0]}")
            tokens = tokens + torch.zeros(e, dtype=torch.float32, device=dev).scatter_add_(
                0, chosen.reshape(-1), m.repeat_interleave(self.top_k)
            )
            probs = probs + (w.float() * m.unsqueeze(-1)).sum(dim=0)
            rows = rows + m.sum()
        return torch.cat([tokens.detach(), probs, rows.detach()])

    def combine(self, total: torch.Tensor) -> torch.Tensor:
        """The aux loss (fp32, before ``coef``) from the statistics summed over the sequence-parallel group."""
        e = self.num_experts
        rows = total[2 * e].clamp(min=1)
        f, p = total[:e] / rows, total[e : 2 * e] / rows
        return (torch.sum(f * p) * e).float()


def _hf_function(model: nn.Module) -> Any:
    return getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)


def _agrees_with_model(spec: RouterAuxLoss, fn: Any) -> str | None:
    """Compare with the model's own function on random logits, with and without a mask (pure, local)."""
    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(6, spec.num_experts, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 1, 1, 0, 0, 0]])
    for m in (None, mask):
        try:
            want = fn(logits, spec.num_experts, spec.top_k, m)
        except Exception as err:  # noqa: BLE001 - any other signature is one we do not know
            return f"its load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask) raised {err!r}"
        got = spec.combine(spec.statistics(logits, m).double())
        if not isinstance(want, torch.Tensor) or not torch.allclose(got, want.float(), rtol=1e-5, atol=1e-6):
            return f"its load_balancing_loss_func gives {want} where the sequence-parallel form gives {got.item()}"
    return None


def router_aux_loss(model: nn.Module) -> tuple[RouterAuxLoss | None, str | None]:
    """(spec, None) when the model adds a router aux loss this package reproduces; (None, None) when it adds none;
    (None, reason) when it adds one that cannot be reproduced (the start-up audit refuses it)."""
    text = text_config(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    records = getattr(decoder, "_can_record_outputs", None) or {}
    is_moe = "router_logits" in records or hasattr(text, "output_router_logits")
    if not is_moe:
        return None, None
    z = {k: getattr(text, k) for k in _Z_LOSS_KEYS if getattr(text, k, None)}
    if not getattr(text, "output_router_logits", False):
        return None, None
    if z:
        return None, f"its router z-loss ({z}) is not reproduced under sequence parallelism"
    if "router_logits" not in records:
        return None, f"{type(decoder).__name__} does not record router logits through transformers' output capture"
    coef = next((getattr(model, a) for a in _COEF_ATTRS if getattr(model, a, None) is not None), None)
    e, k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    fn = _hf_function(model)
    if coef is None or e is None or k is None or fn is None:
        return None, (
            f"{type(model).__name__} does not expose num_experts / num_experts_per_tok / router_aux_loss_coef and "
            "load_balancing_loss_func like transformers' MoE causal LMs"
        )
    spec = RouterAuxLoss(num_experts=int(e), top_k=int(k), coef=float(coef))
    why = _agrees_with_model(spec, fn)
    return (None, why) if why else (spec, None)
