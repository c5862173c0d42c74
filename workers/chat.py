"""Prompts -> token ids: text through the tokenizer, chat messages through the model's own
chat template, token ids checked against the vocabulary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids the chat template gives for ``messages`` plus the assistant turn's start.

    Raises ValueError naming ``messages`` (or ``messages[i]``) for an empty or malformed list.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages: must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}]: must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in ROLES:
            raise ValueError(f"messages[{i}].role: must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: must be a string")
    text = tokenizer.apply_chat_template(
        [{"role": m["role"], "content": m["content"]} for m in messages],
        tokenize=False,
        add_generation_prompt=True,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token decoded on its own, as OpenAI's logprobs show tokens. Special tokens are
    skipped ("") as in the generated text, so the sampled tokens' texts add up to it."""
    return [tokenizer.decode([t], skip_special_tokens=True) for t in ids]


def prompt_token_ids(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """The ids the engine sees for a completion prompt; ValueError naming ``prompt``."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        ids = list(tokenizer.encode(prompt))
    else:
        ids = list(prompt)
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
        ):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if not ids:
        raise ValueError("prompt: must hold at least one token")
    return ids
