"""Prompts -> token ids: text through the tokenizer, chat messages through the model's own
chat template, token ids checked against the vocabulary. Token ids -> what logprobs show of
them: each token's text and its raw bytes."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids the chat template gives for ``messages`` plus, with ``add_generation_prompt``
    (the default), the assistant turn's start; with ``continue_final_message`` instead, the last
    message is left open, so the answer goes on with it (vLLM's options, the template's own:
    a reply begun for the model, e.g. "{" before a JSON answer). ``tools`` (OpenAI's tool
    objects) go to the template as its ``tools``, as transformers passes them; so do an
    assistant message's ``tool_calls`` (each call's arguments as a dict, which templates
    expect) and a tool message's ``tool_call_id``. A template that does not use them leaves
    them out.

    Raises ValueError naming ``messages`` (or ``messages[i]``) for an empty or malformed list,
    and ``continue_final_message`` with ``add_generation_prompt`` or where the template does
    not end with the last message's text.
    """
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages: must be a non-empty list")
    rendered = [_template_message(i, m) for i, m in enumerate(messages)]
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message: continues the last message, so it needs "
            "add_generation_prompt: false (a new turn's start)"
        )
    try:
        text = tokenizer.apply_chat_template(
            rendered,
            tools=list(tools) if tools else None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except ValueError:  # transformers: the final message's text is not where it should be
        if not continue_final_message:
            raise
        raise ValueError(
            "continue_final_message: the chat template does not end with the last message's "
            "text (is it empty?)"
        ) from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template_message(i: int, m: Any) -> dict[str, Any]:
    """A message as the chat template gets it; ValueError naming ``messages[i]``."""
    if not isinstance(m, dict):
        raise ValueError(f"messages[{i}]: must be an object with 'role' and 'content'")
    role, content, calls = m.get("role"), m.get("content"), m.get("tool_calls")
    if not isinstance(role, str) or role not in ROLES:
        raise ValueError(f"messages[{i}].role: must be one of {', '.join(ROLES)}")
    if calls and role != "assistant":
        raise ValueError(f"messages[{i}].tool_calls: only an assistant's message has them")
    call_id = m.get("tool_call_id")
    if role == "tool" and not (isinstance(call_id, str) and call_id):
        raise ValueError(f"messages[{i}].tool_call_id: a tool's message names the call it answers")
    if call_id is not None and role != "tool":
        raise ValueError(f"messages[{i}].tool_call_id: only a tool's message has one")
    if content is None and calls:
        content = ""  # an assistant's turn that only called tools (templates expect a string)
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content: must be a string")
    out: dict[str, Any] = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = [_template_call(c) for c in calls]
    if call_id is not None:
        out["tool_call_id"] = call_id
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier tool call with its arguments as a dict, where they are a JSON object (the
    templates that show calls expect one, as vLLM gives them)."""
    function = dict(call.get("function") or {})
    try:
        args = json.loads(function.get("arguments", ""))
    except (TypeError, ValueError):
        args = None
    if isinstance(args, dict):
        function["arguments"] = args
    return {**call, "function": function}


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token decoded on its own, as OpenAI's logprobs show tokens. Special tokens are
    skipped ("") as in the generated text, so the sampled tokens' texts add up to it."""
    return [tokenizer.decode([t], skip_special_tokens=True) for t in ids]


def decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """The text of ``ids`` as the generated text decodes them (special tokens skipped, unless
    ``skip_special_tokens`` is False)."""
    return str(tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def token_bytes(tokenizer: Any, ids: Sequence[int]) -> list[bytes]:
    """Each token's raw bytes, as OpenAI's logprobs ``bytes`` give them: joined, a text's
    tokens give its UTF-8 even where a token holds only part of a character (byte-level BPE
    spells "Ü" with two tokens), which the token's own text shows as "\ufffd".

    The bytes come from the token's vocabulary string, read as the tokenizer's decoder reads
    it: a byte-level BPE (GPT-2's scheme; SmolLM2 and tiny-random) spells each byte as one
    printable character; SentencePiece with byte fallback has "<0xE3>"-style byte tokens and
    "▁" for a space. Special tokens are b"", as their text is "" (the generated text skips
    them); any other token (an added token, an unknown scheme) is the UTF-8 of its text.
    """
    ids = list(ids)
    spelling = _spelling(tokenizer)
    added = tokenizer.added_tokens_decoder  # id -> AddedToken: not spelled in the scheme
    out: list[bytes] = []
    for t, piece in zip(ids, tokenizer.convert_ids_to_tokens(ids), strict=True):
        if t in added and added[t].special:
            out.append(b"")
            continue
        raw = None if t in added or piece is None else spelling.bytes_of(piece)
        out.append(raw if raw is not None else tokenizer.decode([t]).encode())
    return out


@dataclass(frozen=True)
class _Spelling:
    """How a vocabulary spells bytes, from its decoder's steps."""

    byte_level: bool = False  # GPT-2's printable character per byte
    byte_fallback: bool = False  # "<0xNN>" tokens
    replace: tuple[tuple[str, str], ...] = ()  # SentencePiece's "▁" -> " ", in order

    def bytes_of(self, piece: str) -> bytes | None:
        """The bytes of one vocabulary string; None when this spelling does not say."""
        if self.byte_level:
            table = _byte_level_table()
            # As the ByteLevel decoder does: a string not wholly in the table is its UTF-8.
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        if self.byte_fallback:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m is not None:
                return bytes([int(m[1], 16)])
            for pattern, content in self.replace:
                piece = piece.replace(pattern, content)
            return piece.encode()
        return None


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _spelling(tokenizer: Any) -> _Spelling:
    """The byte spelling a fast tokenizer's decoder implies (the default for any other)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is None:
        return _Spelling()
    # The decoder's own JSON (small, unlike the whole tokenizer's): a step or a Sequence.
    spec = json.loads(decoder.__getstate__())
    steps = spec.get("decoders", [spec]) if spec.get("type") == "Sequence" else [spec]
    types = {s.get("type") for s in steps}
    # "▁" -> " " is a Replace step (Llama's tokenizer.json) or a Metaspace one (newer files).
    replace: list[tuple[str, str]] = []
    for step in steps:
        if step.get("type") == "Replace" and "String" in step.get("pattern", {}):
            replace.append((step["pattern"]["String"], step["content"]))
        elif step.get("type") == "Metaspace":
            replace.append((step.get("replacement", "▁"), " "))
    return _Spelling("ByteLevel" in types, "ByteFallback" in types, tuple(replace))


@functools.cache
def _byte_level_table() -> dict[str, int]:
    """GPT-2's ``bytes_to_unicode`` (transformers' own) inverted: the printable character
    that spells each byte in a byte-level BPE vocabulary -> the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


def prompt_token_ids(tokenizer: Any, prompt: str | Sequence[int], vocab_size: int) -> list[int]:
    """The ids the engine sees for a completion prompt; ValueError naming ``prompt``."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        ids = list(tokenizer.encode(prompt))
    else:
        if not isinstance(prompt, Sequence):  # also not a dict or a set: no order, not ids
            raise ValueError(
                f"prompt: must be text or a list of token ids, got {type(prompt).__name__}"
            )
        ids = list(prompt)
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids
        ):
            raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size})")
    if not ids:
        raise ValueError("prompt: must hold at least one token")
    return ids
