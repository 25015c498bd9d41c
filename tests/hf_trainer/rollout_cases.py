"""The custom rollouts of two GRPO parity cases (``test_trl_parity.py``), given alike to TRL's trainer and to the
Wallfacer one by ``trl_runs.grpo_train`` (option ``rollout``):

- ``"scripted"``: a ``rollout_func`` whose completions are the model's words (the trainer's own generation, called
  from inside it) and an environment's note by rule (``env_mask`` 0, which TRL makes the tool mask: left out of the
  loss), with per-token log-probabilities and an extra per-row field that a reward function reads.
- ``"tools"``: conversational prompts, an environment (``Abacus``: its ``add`` tool, and a reward it owns) and a
  standalone tool (``parity``), and greedy generation that really calls them: the byte-level tokenizer gets a chat
  template that renders tool calls and a response template that parses them (``TOOL_TEMPLATE``,
  ``RESPONSE_TEMPLATE``), and the generation kwargs carry a ``sequence_bias`` that, after a question whose second
  number ends in a chosen digit, makes the tiny random model write a tool call (``forced_calls``): the environment's
  tool (digits 2 and 8), ``parity`` (3), ``parity`` with a wrong argument, a failed call (9), none (the others: a
  short reply). TRL's tool loop then runs the tools and the model replies after their results, which the tool mask
  leaves out of the loss. Every turn ends with EOS, so generation stops early (the case stays quick).
"""
from __future__ import annotations

import re
from typing import Any

TOOL_TEMPLATE = (
    "{% if tools %}<|tools|>\n{% for tool in tools %}{{ tool.function.name }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}"
    "<call>{{ (call.function if call.function is defined else call) | tojson }}</call>"
    "{% endfor %}{{ eos_token }}\n"
    "{% elif message['role'] == 'tool' %}"
    "<|tool|>\n{{ message['content'] }}<|/tool|>\n"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""``chat.CHAT_TEMPLATE`` with tools: their names before the conversation, an assistant's tool calls as
``<call>{"name": ..., "arguments": ...}</call>`` before its EOS (NUL), tool results as ``<|tool|>`` turns. It renders
a prefix of a conversation as the start of the whole one (TRL's tool loop needs that)."""

RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>\n",
    "fields": {
        "tool_calls": {"open": "<call>", "close_pattern": "</call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": "\x00", "content": "text"},
    },
}
"""How transformers parses a completion of ``TOOL_TEMPLATE`` back into a message with its tool calls."""

CALLS = {"2": '{"name": "add", "arguments": {}}', "8": '{"name": "add", "arguments": {}}',
         "3": '{"name": "parity", "arguments": {"n": 3}}', "9": '{"name": "parity", "arguments": {"m": 9}}'}
"""The tool call written after a question whose second number ends in the digit; after the other digits, and after a
tool's result, a short reply (``REPLY``)."""

REPLY = "Done."


def parity(n: int) -> str:
    """Says whether a number is even or odd.

    Args:
        n: the number
    """
    return "even" if n % 2 == 0 else "odd"


class Abacus:
    """An environment per rollout: its tool ``add`` answers the question; the reward it owns counts the calls."""

    def reset(self, answer: int, **kwargs: Any) -> None:
        self.answer, self.calls = int(answer), 0

    def add(self) -> str:
        """Adds the two numbers of the question."""
        self.calls += 1
        return str(self.answer)

    def get_reward(self) -> float:
        return float(self.calls)


def forced_calls(tokenizer: Any, *, bias: float = 100.0) -> list[list]:
    """``sequence_bias`` entries (``[token ids, bias]``) that make greedy decoding write, then stop (EOS): ``CALLS[d]``
    right after a user turn ending in ``"{d}? "``, ``REPLY`` after the others and after a tool's result. Each entry is
    the turn's end with the reply's first k tokens; the model's own log-probabilities of them are what GRPO trains."""
    replies = {f"{d}? <|end|>\n": f"<call>{CALLS[str(d)]}</call>" if str(d) in CALLS else REPLY for d in range(10)}
    replies["<|/tool|>\n"] = REPLY
    entries = []
    for turn_end, reply in replies.items():
        context = tokenizer.encode(f"{turn_end}<|assistant|>\n", add_special_tokens=False)
        script = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        entries += [[context + script[: k + 1], bias] for k in range(len(script))]
    return entries


def scripted_rollout(prompts: list[str], trainer: Any) -> dict[str, list]:
    """A completion per prompt: the model's words (the trainer's own greedy generation, which under sequence
    parallelism generates this rank's share), an environment's note by rule (``env_mask`` 0), a fixed end;
    log-probabilities exact in binary; ``hint``, an extra field for the reward functions."""
    tok = trainer.processing_class
    prompt_ids = [tok.encode(prompt, add_special_tokens=False) for prompt in prompts]
    said, _ = trainer._generate_single_turn(prompt_ids, None, {}, 1)
    out: dict[str, list] = {"prompt_ids": prompt_ids, "completion_ids": [], "logprobs": [], "env_mask": [],
                            "hint": []}
    for prompt, words in zip(prompts, said):
        a, b = (int(x) for x in re.findall(r"\d+", prompt)[-2:])
        words = words[:-1] if words[-1:] == [tok.eos_token_id] else words
        noted, end = (tok.encode(text, add_special_tokens=False) for text in (f" [env: {(a * b) % 7}] ", "."))
        completion = words + noted + end + [tok.eos_token_id]
        out["completion_ids"].append(completion)
        out["env_mask"].append([1] * len(words) + [0] * len(noted) + [1] * (len(end) + 1))
        out["logprobs"].append([-0.25 * (k % 3) for k in range(len(completion))])
        out["hint"].append(b % 3)
    return out


def hint_reward(completions: list, hint: list[int], **kwargs: Any) -> list[float]:
    """The rollout's extra field as a reward."""
    return [0.25 * h for h in hint]


def turns_reward(completions: list[list[dict]], **kwargs: Any) -> list[float]:
    """0.5 per tool result in a conversational completion (the arithmetic reward reads text)."""
    return [0.5 * sum(m["role"] == "tool" for m in c) for c in completions]


def rollout_setup(kind: str, tokenizer: Any, rows: list[dict[str, Any]],
                  rewards: list) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(GRPOConfig keywords, trainer keywords, the dataset's rows) of a custom rollout ``kind``, given the case's
    ``rewards``."""
    from ds_wallfacer.hf_trainer.rl_data import arithmetic_reward

    if kind == "scripted":
        return {}, {"rollout_func": scripted_rollout, "reward_funcs": [*rewards, hint_reward]}, rows
    if kind != "tools":
        raise ValueError(f"unknown rollout {kind!r}; expected 'scripted' or 'tools'")
    tokenizer.chat_template = TOOL_TEMPLATE
    tokenizer.response_template = RESPONSE_TEMPLATE
    config = {"max_completion_length": 100, "max_tool_calling_iterations": 2,
              "generation_kwargs": {"do_sample": False, "sequence_bias": forced_calls(tokenizer)}}
    chats = [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
    return config, {"tools": [parity], "environment_factory": Abacus,
                    "reward_funcs": [turns_reward if r is arithmetic_reward else r for r in rewards]}, chats
