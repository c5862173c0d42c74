"""The token half of the ``Backend`` contract, one implementation for both backends.

``ClusterBackend`` (the ingress's tokenizer) and ``LocalBackend`` (its engine's) answer the
tokenize / detokenize routes and tokenize prompts the same way: with one tokenizer, ids bounded
by the model's vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvmesh.cluster.backend import GenerateRequest
from kvmesh.workers.bad_words import bad_words_token_ids
from kvmesh.workers.chat import chat_prompt_ids, decode, prompt_token_ids, token_bytes, token_texts


class TokenMethods:
    """Mixed into a backend that sets ``tokenizer`` and ``vocab_size``."""

    tokenizer: Any
    vocab_size: int

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """The ids the engine will see for ``prompt`` (what ``make_request`` computes)."""
        return prompt_token_ids(self.tokenizer, prompt, self.vocab_size)

    def tokenize_chat(self, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages, **template)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return token_texts(self.tokenizer, ids)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return token_bytes(self.tokenizer, ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return decode(self.tokenizer, ids, skip_special_tokens)

    def bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        return bad_words_token_ids(self.tokenizer, words, self.vocab_size)

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The request's prompt as ids: the HTTP layer's when it tokenized it already."""
        if request.prompt_ids is not None:
            return list(request.prompt_ids)
        if request.messages is not None:
            return self.tokenize_chat(request.messages)
        if request.prompt is None:
            raise ValueError("prompt: give a prompt or messages")
        return self.tokenize(request.prompt)
