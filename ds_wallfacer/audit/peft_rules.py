"""PEFT models under the sequence rules: which PEFT wrappers pass through and which adapters are refused.

A ``get_peft_model`` model wraps the HF model twice (``PeftModel``, then the tuner, e.g. ``LoraModel``) and
replaces targeted layers by adapter layers. The wrappers' own code holds sequence operations only for prompt
learning (prefix, prompt and p-tuning prepend virtual tokens to the sequence), so they pass the rules when no
adapter learns prompts; the adapter layers (LoRA's ``Linear``, ``Embedding``...) are audited like any module.
Activated LoRA (``alora_invocation_tokens``) switches the adapter on from a token found in the sequence onward:
a rank's shard cannot know where that token is, so it is refused. Pure: reads classes and configs.
"""
from __future__ import annotations

import sys
from typing import Any

from torch import nn

__all__ = ["peft_findings"]


def _adapter_problems(config: Any) -> list[str]:
    out = []
    if getattr(config, "is_prompt_learning", False):
        out.append(f"{type(config).__name__} learns virtual tokens that are added to the sequence")
    if getattr(config, "alora_invocation_tokens", None):
        out.append("activated LoRA (alora_invocation_tokens) turns the adapter on from a token found in the "
                   "sequence, which a rank's shard cannot see")
    return out


def peft_findings(model: nn.Module) -> tuple[set[int], list[tuple[str, str, str]]]:
    """(ids of the PEFT wrapper modules that pass, [(path, class, problem)] for adapters that cannot train)."""
    if "peft" not in sys.modules:  # a model cannot hold PEFT modules unless peft was imported
        return set(), []
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    wrappers = [(path or "<model>", m) for path, m in model.named_modules() if isinstance(m, (PeftModel, BaseTuner))]
    problems = []
    for path, m in wrappers:
        for name, config in (getattr(m, "peft_config", None) or {}).items():
            problems += [(path, type(m).__name__, f"adapter {name!r}: {p}") for p in _adapter_problems(config)]
    return ({id(m) for _, m in wrappers} if not problems else set()), problems
