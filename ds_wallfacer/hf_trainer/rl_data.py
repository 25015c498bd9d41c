"""The synthetic preference and prompt data of the DPO and GRPO examples (``launch/train_dpo.py``,
``launch/train_grpo.py``) and their tests, written in TRL's dataset forms with nothing downloaded.

- ``make_preferences``: ``{"prompt", "chosen", "rejected"}`` rows: an addition question, the right sum and a wrong
  one (off by a small amount), so a tiny model learns to prefer the right digits.
- ``make_prompts``: ``{"prompt", "answer"}`` rows for GRPO, and ``arithmetic_reward``, a rule-based reward: 1 when
  the completion's first number is the answer, 0.5 when it starts with a digit at all, else 0.

Lengths: ``filler`` repeats a fixed context sentence before each question, so the examples and the benchmark can
make rows as long as they need (the question stays at the end).
"""
from __future__ import annotations

import random
import re
from typing import Any

__all__ = ["arithmetic_reward", "make_preferences", "make_prompts"]

_CONTEXT = "Numbers are added digit by digit from the right, carrying tens. "


def _question(rng: random.Random, filler: int) -> tuple[str, int]:
    a, b = rng.randrange(2, 50), rng.randrange(2, 50)
    return f"{_CONTEXT * filler}What is {a} plus {b}? ", a + b


def make_preferences(n: int, *, seed: int = 0, filler: int = 0) -> list[dict[str, str]]:
    """``n`` preference pairs: the right sum chosen, a wrong one rejected."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, total = _question(rng, filler)
        wrong = total + rng.choice([-11, -2, -1, 1, 2, 10])
        rows.append({"prompt": prompt, "chosen": f"{total}.", "rejected": f"{wrong}."})
    return rows


def make_prompts(n: int, *, seed: int = 0, filler: int = 0) -> list[dict[str, Any]]:
    """``n`` GRPO prompts with their answers (TRL passes the ``answer`` column to the reward functions)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        prompt, total = _question(rng, filler)
        rows.append({"prompt": prompt, "answer": total})
    return rows


def arithmetic_reward(completions: list[str], answer: list[int], **kwargs: Any) -> list[float]:
    """1.0 for a completion whose first number is the answer, 0.5 for one that starts with a digit, else 0.0."""
    out = []
    for text, want in zip(completions, answer):
        found = re.match(r"\s*(\d+)", text)
        out.append(1.0 if found and int(found.group(1)) == int(want) else 0.5 if found else 0.0)
    return out
