"""vLLM's ``bad_words``: words a request never generates.

``bad_words_token_ids`` turns the words into token id sequences with the tokenizer, where the
request's text is tokenized (the API layer, the cluster's ingress; for the Python API
``LLMEngine.make_request``), so ``SamplingParams.bad_words_token_ids`` is all the engine's step
reads: ``banned_tokens`` (in ``penalties.py``) needs no tokenizer.

The rule is vLLM's (``SamplingParams.update_from_tokenizer``) less its length check: each word,
its leading whitespace stripped, is encoded without special tokens as it is, and again after
a space (byte-level BPE spells a word after a space as a token of its own, "Ġword"); the
spaced variant is kept unless it ends with the plain one's tokens, whose ban then covers it.
vLLM keeps it only when it also has as many tokens as the plain one, so a word that is one
token after a space and two without ("rainbow": "ra" "inbow", but " rainbow" one token) is
banned only at the start of the text: a known bug (vllm #23886, #32557), seen here with
smollm2, not copied. At each step
a sequence of one token bans that token; a longer one bans its last token when the output so
far (resumed tokens included; never the prompt) ends with the tokens before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvmesh.workers.sampling_params import SamplingParams

TokenIdSequences = tuple[tuple[int, ...], ...]


def bad_words_token_ids(tokenizer: Any, words: Sequence[str], vocab_size: int) -> TokenIdSequences:
    """``words`` as token id sequences (vLLM's rule, the module docstring); ValueError naming
    ``bad_words`` when a word has no tokens, a token is outside the vocabulary [0,
    ``vocab_size``) or the sequences hold more tokens than SamplingParams takes."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        plain = _encode(tokenizer, word.lstrip(), word)
        seqs.append(plain)
        spaced = _encode(tokenizer, " " + word.lstrip(), word)
        if spaced[-len(plain) :] != plain:
            seqs.append(spaced)
    if any(t >= vocab_size for s in seqs for t in s):
        raise ValueError(
            f"bad_words: their tokens must be in the model's vocabulary, [0, {vocab_size})"
        )
    total, most = sum(map(len, seqs)), SamplingParams.MAX_BAD_WORDS_TOKENS
    if total > most:
        raise ValueError(f"bad_words: they make {total} tokens (with their spaced variants); "
                         f"at most {most}")  # fmt: skip
    return tuple(seqs)


def with_bad_words_token_ids(
    params: SamplingParams, tokenizer: Any, vocab_size: int
) -> SamplingParams:
    """``params`` with ``bad_words_token_ids`` filled from its ``bad_words`` (the same params
    when it has no bad words, or their token ids already)."""
    if not params.bad_words or params.bad_words_token_ids:
        return params
    ids = bad_words_token_ids(tokenizer, params.bad_words, vocab_size)
    return replace(params, bad_words_token_ids=ids)


def banned_tokens(seqs: TokenIdSequences, output: Sequence[int]) -> set[int]:
    """The tokens ``seqs`` ban at the next step after ``output`` (the module docstring)."""
    n = len(output)
    banned: set[int] = set()
    for s in seqs:
        k = len(s) - 1  # the prefix the output must end with
        if k == 0 or (k <= n and output[-1] == s[-2] and tuple(output[n - k :]) == s[:-1]):
            banned.add(s[-1])
    return banned


def _encode(tokenizer: Any, text: str, word: str) -> tuple[int, ...]:
    ids = tuple(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise ValueError(f"bad_words: {word[:40]!r} has no tokens")
    return ids
