"""Chat messages -> prompt token ids through the model's own chat template."""

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
