"""OpenAI's response objects, built as plain dicts: ``ResponseShape`` (chat.completion,
text_completion and their stream chunks, with logprobs) and ``usage``.

The models in ``response_models.py`` describe exactly these dicts for the OpenAPI schema, and
the tests check the two agree.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any, Literal

from kvmesh.cluster.backend import Completion


def usage(c: Completion) -> dict[str, Any]:
    prompt, completion = len(c.prompt_token_ids), len(c.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": c.cached_tokens},
    }


class ResponseShape:
    """Builds one endpoint's objects: ``chat`` (chat.completion / chat.completion.chunk) or
    ``text`` (text_completion for both)."""

    def __init__(
        self,
        kind: Literal["chat", "text"],
        request_id: str,
        model: str,
        logprobs: int | None = None,
    ) -> None:
        self.kind, self.id, self.model = kind, request_id, model
        self.logprobs = logprobs  # top alternatives per token; None: no logprobs
        self._text_offset = 0  # completions' logprobs.text_offset, across stream chunks
        self.created = int(time.time())

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(
        self, c: Completion, token_texts: Callable[[list[int]], list[str]] | None = None
    ) -> dict[str, Any]:
        """The non-streaming response; ``token_texts`` names tokens in its logprobs."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        logprobs = self._logprobs(c.token_ids, c.logprobs, token_texts)
        choice |= {"logprobs": logprobs, "finish_reason": c.finish_reason}
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return self._head(obj) | {
            "choices": [choice],
            "usage": usage(c),
            "kvmesh": c.kv.to_dict(),
        }

    def _logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, float]] | None,
        token_texts: Callable[[list[int]], list[str]] | None,
    ) -> dict[str, Any] | None:
        """OpenAI's logprobs object for these generated tokens: ``content`` items for chat;
        ``tokens``, ``token_logprobs``, ``top_logprobs`` and ``text_offset`` (counted from the
        start of the completion, across stream chunks) for completions."""
        if self.logprobs is None or entries is None or token_texts is None:
            return None
        # (sampled token, its logprob, the top alternatives best first) per generated token
        rows = [
            (tok, entry[tok], sorted(entry.items(), key=lambda kv: -kv[1])[: self.logprobs])
            for tok, entry in zip(token_ids, entries, strict=False)
        ]
        ids = sorted({t for entry in entries for t in entry})
        text = dict(zip(ids, token_texts(ids), strict=True))
        if self.kind == "chat":

            def item(t: int, lp: float) -> dict[str, Any]:
                return {"token": text[t], "logprob": lp, "bytes": list(text[t].encode())}

            content = [
                item(t, lp) | {"top_logprobs": [item(a, b) for a, b in top]} for t, lp, top in rows
            ]
            return {"content": content, "refusal": None}
        offsets = list(itertools.accumulate((len(text[t]) for t, _, _ in rows), initial=0))
        start, self._text_offset = self._text_offset, self._text_offset + offsets[-1]
        return {
            "tokens": [text[t] for t, _, _ in rows],
            "token_logprobs": [lp for _, lp, _ in rows],
            # Two tokens can share a text (a "\ufffd" byte piece): the best one names it.
            "top_logprobs": [{text[a]: b for a, b in reversed(top)} for _, _, top in rows],
            "text_offset": [start + o for o in offsets[:-1]],
        }

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        *,
        role: bool = False,
        completion: Completion | None = None,
        logprobs: tuple[list[int], list[dict[int, float]]] | None = None,
        token_texts: Callable[[list[int]], list[str]] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk; the last one (with ``completion``) also carries ``kvmesh``.
        ``logprobs``: the chunk's tokens and their logprob entries."""
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text or role:
                delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text
        lp = self._logprobs(*logprobs, token_texts) if logprobs is not None else None
        choice |= {"logprobs": lp, "finish_reason": finish_reason}
        out = self._head(self.chunk_object) | {"choices": [choice]}
        if completion is not None:
            out["kvmesh"] = completion.kv.to_dict()
        return out

    def usage_chunk(self, c: Completion) -> dict[str, Any]:
        """``stream_options.include_usage``: the extra last chunk, with no choices."""
        return self._head(self.chunk_object) | {
            "choices": [],
            "usage": usage(c),
            "kvmesh": c.kv.to_dict(),
        }

    @property
    def chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"
