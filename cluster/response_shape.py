"""OpenAI's response objects, built as plain dicts: ``ResponseShape`` (chat.completion,
text_completion and their stream chunks, with logprobs) and ``usage``.

The models in ``response_models.py`` describe exactly these dicts for the OpenAPI schema, and
the tests check the two agree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.backend import Chunk, Completion
from kvmesh.cluster.tool_calls import (
    ToolCallDeltas,
    ToolCalling,
    message_tool_calls,
    tools_refusal,
)

# A logprob of -inf (a token a structured output's grammar masks out) is shown as this, as
# vLLM shows it: JSON has no infinity.
MIN_LOGPROB = -9999.0
Entries = Sequence[dict[int, float] | None]  # per token: its logprob and the top N, or None

# Tokens decoded again with each next token to see what text it adds (``_TextOffsets``): more
# than one character's tokens (up to 4 in a byte-level BPE: one per UTF-8 byte), with room for
# special tokens between them. No byte-level BPE or SentencePiece decoder looks further back.
OFFSET_WINDOW = 8


class Vocab(Protocol):
    """What logprobs need from the tokenizer (a ``Backend`` has all of it)."""

    def token_texts(self, ids: Sequence[int]) -> list[str]: ...

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def usage(completions: Sequence[Completion], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage of all the choices, ``n`` per prompt in prompt order: each prompt's
    tokens once (as its first choice saw them, cache hits too), every choice's output."""
    firsts = completions[::n]
    prompt = sum(len(c.prompt_token_ids) for c in firsts)
    completion = sum(len(c.token_ids) for c in completions)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in firsts)},
    }


class Echo:
    """Completions' ``echo``: a prompt's text and token ids, put before each of its choices'
    text (and, with logprobs, its tokens' logprobs before theirs)."""

    def __init__(self, text: str, token_ids: list[int]) -> None:
        self.text, self.token_ids = text, token_ids


class ResponseShape:
    """Builds one endpoint's objects: ``chat`` (chat.completion / chat.completion.chunk) or
    ``text`` (text_completion for both), for choices ``n`` per prompt (index
    prompt * n + j, as OpenAI numbers them). ``echo``: per prompt, what completions' echo
    puts first (text only); ``prompt_only`` (echo with max_tokens 0): the generated token is
    not shown, nor counted. ``tools``: a chat's answers are tool calls, shown as
    ``tool_calls`` (a stream's as OpenAI's deltas), with no ``content``."""

    def __init__(
        self,
        kind: Literal["chat", "text"],
        request_id: str,
        model: str,
        logprobs: int | None = None,
        n: int = 1,
        echo: list[Echo] | None = None,
        prompt_only: bool = False,
        tools: ToolCalling | None = None,
    ) -> None:
        self.kind, self.id, self.model, self.n = kind, request_id, model, n
        self.tools = tools  # chat: the answer is tool calls (``tool_calls.py``)
        self._tool_deltas: dict[int, ToolCallDeltas] = {}
        self.logprobs = logprobs  # top alternatives per token; None: no logprobs
        self.echo = echo
        self.prompt_only = prompt_only
        # Per streamed choice: completions' logprobs.text_offset across chunks, and the
        # characters of text streamed so far.
        self._offsets: dict[int, _TextOffsets] = defaultdict(_TextOffsets)
        self._text_len: dict[int, int] = defaultdict(int)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(
        self, completions: Sequence[Completion], vocab: Vocab | None = None
    ) -> dict[str, Any]:
        """The non-streaming response, a choice per completion in index order; ``vocab``
        names the tokens in its logprobs. ``kvmesh`` is the first choice's; with several,
        each choice has its own too."""
        completions = [self.shown(c) for c in completions]
        choices = []
        for index, c in enumerate(completions):
            choice: dict[str, Any] = {"index": index}
            echo = self._echo(index)
            if self.kind == "chat":
                choice["message"] = {"role": "assistant", "content": c.text}
                if self.tools is not None:
                    calls = message_tool_calls(self.tools, c.text)
                    choice["message"] |= {"content": None, "tool_calls": calls}
            else:
                choice["text"] = (echo.text if echo else "") + c.text
            offsets = _TextOffsets()
            base = len(echo.text) if echo else 0
            logprobs = self._logprobs(c.token_ids, c.logprobs, vocab, len(c.text), offsets, base)
            if echo is not None and logprobs is not None:
                logprobs = self._echo_logprobs(echo, c.prompt_logprobs, vocab, logprobs)
            choice |= {"logprobs": logprobs, "finish_reason": self._finish_reason(c.finish_reason)}
            if len(completions) > 1:
                choice["kvmesh"] = c.kv.to_dict()
            choices.append(choice)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._head(obj) | {
            "choices": choices,
            "usage": usage(completions, self.n),
            "kvmesh": completions[0].kv.to_dict(),
        }

    def shown(self, c: Completion) -> Completion:
        """What the client sees of a completion: with ``prompt_only``, nothing generated."""
        if not self.prompt_only:
            return c
        lp = [] if c.logprobs is not None else None
        return dataclasses.replace(c, text="", token_ids=[], logprobs=lp, finish_reason="length")

    def shown_chunk(self, chunk: Chunk) -> Chunk:
        """A stream's chunk as the client sees it (``shown``): with ``prompt_only``, only its
        end, which also carries the prompt's logprobs."""
        if not self.prompt_only:
            return chunk
        done = chunk.finish_reason is not None
        return Chunk(
            chunk.request_id,
            finish_reason="length" if done else None,
            completion=chunk.completion,
            prompt_logprobs=chunk.prompt_logprobs,
        )

    @contextlib.contextmanager
    def refusals(self) -> Iterator[None]:
        """The backend's refusals as the client's fields name them: with tools, a worker's
        refusal of the calls' grammar (the engine names it ``structured_outputs``) names
        ``tools``."""
        try:
            yield
        except ApiError as e:
            if self.tools is None:
                raise
            raise tools_refusal(e) from None

    def _finish_reason(self, reason: str | None) -> str | None:
        if reason is None or self.tools is None:
            return reason
        return self.tools.finish_reason(reason)

    def _echo(self, index: int) -> Echo | None:
        return self.echo[index // self.n] if self.echo is not None else None

    def _echo_logprobs(
        self, echo: Echo, entries: Entries | None, vocab: Vocab | None, after: dict[str, Any]
    ) -> dict[str, Any]:
        """The prompt's tokens' logprobs (its first has none) followed by ``after``'s."""
        if entries is None:  # not computed (cannot happen over HTTP): the completion's only
            return after
        head = self._logprobs(echo.token_ids, entries, vocab, len(echo.text), _TextOffsets())
        assert head is not None
        return {key: head[key] + after[key] for key in head}

    def _logprobs(
        self,
        token_ids: list[int],
        entries: Entries | None,
        vocab: Vocab | None,
        text_len: int,
        offsets: _TextOffsets,
        base: int = 0,
    ) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these tokens: ``content`` items for chat; ``tokens``,
        ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (counted from the start of
        the completion, across stream chunks, plus ``base``: an echoed prompt's length) for
        completions. ``text_len``: the characters of text given out so far, these tokens'
        included. An entry None (an echoed prompt's first token) gives nulls."""
        if self.logprobs is None or entries is None or vocab is None:
            return None
        # (token, its logprob, the top alternatives best first) per token
        rows = [
            (tok, None, None)
            if entry is None
            else (
                tok,
                max(entry[tok], MIN_LOGPROB),
                [
                    (t, max(lp, MIN_LOGPROB))
                    for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[: self.logprobs]
                ],
            )
            for tok, entry in zip(token_ids, entries, strict=False)
        ]
        ids = sorted({t for entry in entries if entry for t in entry} | {t for t, _, _ in rows})
        # A token's text is its own decode, so one that holds part of a character shows
        # "\ufffd" (as OpenAI shows such tokens); its bytes are the token's own.
        text = dict(zip(ids, vocab.token_texts(ids), strict=True))
        if self.kind == "chat":
            raw = dict(zip(ids, vocab.token_bytes(ids), strict=True))

            def item(t: int, lp: float) -> dict[str, Any]:
                return {"token": text[t], "logprob": lp, "bytes": list(raw[t])}

            content = [
                item(t, lp) | {"top_logprobs": [item(a, b) for a, b in top]}
                for t, lp, top in rows
                if lp is not None and top is not None
            ]
            return {"content": content, "refusal": None}
        starts = offsets.add([t for t, _, _ in rows], vocab.decode)
        return {
            "tokens": [text[t] for t, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            # Two tokens can share a text (a "\ufffd" byte piece): the best one names it.
            "top_logprobs": [
                None if top is None else {text[a]: b for a, b in reversed(top)}
                for _, _, top in rows
            ],
            # Tokens past a stop string have text the completion cut off: at its end.
            "text_offset": [base + min(o, text_len) for o in starts],
        }

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        index: int = 0,
        role: bool = False,
        completion: Completion | None = None,
        logprobs: tuple[list[int], list[dict[int, float]]] | None = None,
        vocab: Vocab | None = None,
    ) -> dict[str, Any]:
        """A stream chunk of choice ``index``; its last one (with ``completion``) also
        carries ``kvmesh``. ``logprobs``: the chunk's tokens and their logprob entries, named
        by ``vocab``."""
        choice: dict[str, Any] = {"index": index}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if self.tools is not None:
                deltas = self._tool_deltas.setdefault(index, ToolCallDeltas(self.tools))
                if calls := deltas.add(text):
                    delta["tool_calls"] = calls
            elif text or role:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        self._text_len[index] += len(text)
        lp = None
        if logprobs is not None:
            echo = self._echo(index)
            base = len(echo.text) if echo else 0
            offsets = self._offsets[index]
            lp = self._logprobs(*logprobs, vocab, self._text_len[index], offsets, base)
        choice |= {"logprobs": lp, "finish_reason": self._finish_reason(finish_reason)}
        out = self._head(self.chunk_object) | {"choices": [choice]}
        if completion is not None:
            out["kvmesh"] = completion.kv.to_dict()
        return out

    def echo_chunk(self, index: int, entries: Entries | None, vocab: Vocab) -> dict[str, Any]:
        """Completions' echo in a stream: choice ``index``'s first chunk, its prompt's text
        and (with logprobs) its prompt tokens' logprobs."""
        echo = self._echo(index)
        assert echo is not None
        lp = None
        if self.logprobs is not None and entries is not None:
            lp = self._logprobs(echo.token_ids, entries, vocab, len(echo.text), _TextOffsets())
        choice = {"index": index, "text": echo.text, "logprobs": lp, "finish_reason": None}
        return self._head(self.chunk_object) | {"choices": [choice]}

    def usage_chunk(self, completions: Sequence[Completion]) -> dict[str, Any]:
        """``stream_options.include_usage``: the extra last chunk, with no choices; usage of
        every choice, ``kvmesh`` the first choice's."""
        return self._head(self.chunk_object) | {
            "choices": [],
            "usage": usage([self.shown(c) for c in completions], self.n),
            "kvmesh": completions[0].kv.to_dict(),
        }

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"


class _TextOffsets:
    """Completions' ``text_offset``: where in the generated text each token's text starts,
    as decoding the tokens one by one shows it (the text streams that way too).

    A token can end in part of a character (a byte-level BPE spells "Ü" with two tokens): the
    text so far then ends in a "\ufffd" that the next token replaces with the character. So a
    token's text starts where the text stops changing: after what it and every later token
    leave as it was, the pending "\ufffd" excluded. Every token of a character gets the
    offset where the character starts, and ``text[offset:]`` begins with what a token added.
    """

    def __init__(self) -> None:
        # The last tokens and their text: only they are decoded again (linear cost); text
        # before them no longer changes.
        self.window: list[int] = []
        self.window_text = ""
        self.length = 0  # characters the tokens so far decode to
        self.pending = False  # the text ends in a "\ufffd" that a next token may rewrite
        self.given = 0  # the last offset given out: offsets never go back across chunks

    def add(self, ids: Sequence[int], decode: Callable[[Sequence[int]], str]) -> list[int]:
        """The offsets of ``ids``, the tokens after those already added."""
        kept = []  # per token: the characters before it that it leaves unchanged
        for t in ids:
            # The window's text with and without ``t`` start alike (a window that starts
            # mid-character shows "\ufffd"s in both), so one shift maps them to the text.
            after = decode([*self.window, t])
            shift = self.length - len(self.window_text)
            kept.append(shift + _common_prefix_len(self.window_text, after))
            self.length, self.pending = shift + len(after), after.endswith("\ufffd")
            self.window.append(t)
            self.window_text = after
            if len(self.window) >= 2 * OFFSET_WINDOW:  # cut back: one decode per OFFSET_WINDOW
                self.window = self.window[-OFFSET_WINDOW:]
                self.window_text = decode(self.window)
        offsets, settled = [], self.length - self.pending
        for k in reversed(kept):
            settled = min(settled, k)
            offsets.append(max(settled, self.given))
        offsets.reverse()
        self.given = offsets[-1] if offsets else self.given
        return offsets


def _common_prefix_len(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
