"""Incremental detokenization with stop strings.

Text is decoded from all output tokens each time (short outputs; this keeps multi-byte
characters and tokenizer merges right), and a delta is released only when it is final: an
incomplete UTF-8 character, or a tail that could still grow into a stop string, is held back.
So the concatenated stream always equals the final text. Before ``min_tokens`` output tokens
no stop string counts (vLLM's ``min_tokens``): none is searched for, and once they count, only
one that ends in text not yet emitted stops the request. The text ends before the stop
string, or with it when ``include_stop`` (vLLM's ``include_stop_str_in_output``). Special
tokens are left out of the text unless ``skip_special_tokens`` is False (vLLM's).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Resumed tokens replayed one at a time (see Detokenizer.replay); far more than any
# tokenizer's decoder looks back.
REPLAY_WINDOW = 64


class Detokenizer:
    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        min_tokens: int = 0,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.text = ""  # the text so far, cut at (or after) a stop string once one is found
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped_by: str | None = None

    def update(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Decode ``token_ids`` (all output tokens so far); return the new, settled text."""
        may_stop = len(token_ids) >= self.min_tokens
        if self.stopped_by is None:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
            # Search only where a stop string could newly appear: ending past what was emitted
            # (emitted text holds none, or holds one from before min_tokens, which never counts).
            stops = self.stop if may_stop else ()
            found = [(text.find(s, max(0, self.emitted - len(s) + 1)), s) for s in stops]
            found = [(at, s) for at, s in found if at != -1]
            if found:
                at, self.stopped_by = min(found)
                self.text = text[: at + len(self.stopped_by) if self.include_stop else at]
            else:
                self.text = text
        end = len(self.text)
        if not final and self.stopped_by is None:
            if self.text.endswith("\ufffd"):
                end -= 1
            # Held back before min_tokens too: a stop string begun then may end after it.
            end -= self._stop_prefix_len(self.text[:end])
        delta = self.text[self.emitted : end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    def replay(self, token_ids: Sequence[int], window: int = REPLAY_WINDOW) -> None:
        """Take the state that streaming ``token_ids`` one at a time (none final) leaves,
        emitting nothing: for a request resumed after another worker streamed these tokens.

        What a stream released can depend on the way there when a tokenizer rewrites earlier
        text as tokens follow (a dangling byte becoming a character, cleaned-up spaces), so
        the last ``window`` tokens are fed one at a time, as the stream fed them; the ones
        before go in one decode. Exact when no token rewrites text more than ``window``
        tokens back, which holds for byte-level BPE, SentencePiece and WordPiece decoders;
        feeding every token would cost O(len(token_ids)^2) characters decoded.
        """
        head = max(0, len(token_ids) - window)
        if head:
            if 0 < self.min_tokens - 1 < head:  # a stop string ended by then never counts
                self.update(token_ids[: self.min_tokens - 1])
            self.update(token_ids[:head])
        for n in range(head + 1, len(token_ids) + 1):
            self.update(token_ids[:n])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best
