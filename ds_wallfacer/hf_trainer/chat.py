"""The tiny chat dataset and chat tokenizer of the SFT example (``launch/train_trl.py``) and its tests.

``examples/chat.jsonl`` (shipped with the example configs, apart from the text corpus in ``data/``) holds short
synthetic conversations in the ``{"messages": [...]}`` form TRL reads: arithmetic, spelling backwards, counting
letters, some two-turn. They are written by ``make_chats`` (run ``python -m ds_wallfacer.hf_trainer.chat`` to
write them again) so that a tiny model can learn the assistant turns in a few hundred steps, with nothing
downloaded. ``chat_tokenizer`` is the byte-level tokenizer of the built-in presets with a chat template whose
``{% generation %}`` blocks mark the assistant turns (what ``assistant_only_loss`` needs) and NUL as end of
sequence and padding.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

__all__ = ["CHAT_DATA", "CHAT_TEMPLATE", "chat_tokenizer", "load_chats", "make_chats"]

CHAT_DATA = Path(__file__).resolve().parents[1] / "examples" / "chat.jsonl"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}\n"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""Role markers in plain text (the byte-level vocabulary has no special tokens); an assistant turn ends with the
EOS token, and the reply with its EOS is the generation, so the loss covers exactly what the model must learn to
produce, stopping included."""

_WORDS = ("river", "stone", "light", "garden", "window", "silver", "planet", "forest", "candle", "bridge",
          "market", "winter", "orange", "rocket", "pencil", "island", "dragon", "meadow", "copper", "violin")


def _turn(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(2, 60), rng.randrange(2, 60)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        w = rng.choice(_WORDS)
        return f"Spell '{w}' backwards.", f"'{w}' backwards is '{w[::-1]}'."
    if kind == 2:
        w, ch = rng.choice(_WORDS), rng.choice("aeiornt")
        return f"How many times does '{ch}' occur in '{w}'?", f"'{ch}' occurs {w.count(ch)} times in '{w}'."
    a, b = rng.sample(_WORDS, 2)
    first = min(a, b)
    return f"Which comes first in the alphabet, '{a}' or '{b}'?", f"'{first}' comes first."


def make_chats(n: int = 240, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversations (every fifth has two exchanges, every seventh a system message), deterministic in
    ``seed``."""
    rng = random.Random(seed)
    chats = []
    for i in range(n):
        messages = [{"role": "system", "content": "You answer in one short sentence."}] if i % 7 == 0 else []
        for _ in range(2 if i % 5 == 0 else 1):
            question, answer = _turn(rng)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages})
    return chats


def load_chats(path: str | Path = CHAT_DATA) -> list[dict[str, Any]]:
    """The conversations of a ``.jsonl`` file, one ``{"messages": [...]}`` object per line."""
    rows = []
    for k, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("messages"), list):
            raise ValueError(f"{path}:{k}: expected an object with a 'messages' list, got keys {sorted(row)}")
        rows.append(row)
    return rows


def chat_tokenizer() -> Any:
    """The byte-level tokenizer with ``CHAT_TEMPLATE``, NUL (id 0) as EOS and padding."""
    from ..train.model import BYTE_EOS_ID, byte_tokenizer

    tok = byte_tokenizer()
    nul = tok.convert_ids_to_tokens(BYTE_EOS_ID)
    tok.eos_token = tok.pad_token = nul
    tok.chat_template = CHAT_TEMPLATE
    return tok


if __name__ == "__main__":  # write chat.jsonl again
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else CHAT_DATA
    out.write_text("".join(json.dumps(c) + "\n" for c in make_chats()), encoding="utf-8")
