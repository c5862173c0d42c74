"""A worker's structured-output matchers (``structured_output.py`` says what is constrained
and how): the worker's tokenizer as llguidance's, a matcher per request, and the step's
masks.

The masks are llguidance's bitmasks (bit t of a row's int32 words: token t allowed) in numpy
arrays its matchers write into. ``llguidance.torch`` would do the same but is not imported:
its module-level ``torch.compile`` loads dynamo and inductor, 2.1 s of every worker's start.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from typing import Any

import llguidance
import numpy as np
import torch

from kvmesh.workers.structured_output import LIMITS, StructuredOutputsParams, brief


class Grammars:
    """One worker's matchers: its tokenizer as llguidance's (made at the first request that
    needs it: ~0.3 s for a 49k vocabulary), a matcher per request, and the masks."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]):
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf  # transformers: only where a tokenizer is wrapped

                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    def matcher(
        self, params: StructuredOutputsParams, resumed_token_ids: Sequence[int] = ()
    ) -> llguidance.LLMatcher:
        """A matcher for ``params`` that has taken ``resumed_token_ids`` (ValueError naming
        the field when the grammar fails with this tokenizer or refuses them)."""
        grammar = params.llguidance_grammar()
        limits = llguidance.LLParserLimits(**LIMITS)
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if not m.is_error() and resumed_token_ids and not m.consume_tokens(list(resumed_token_ids)):
            raise ValueError(
                "resumed_token_ids: structured_outputs does not allow them (they were not "
                "generated under the same constraint)"
            )
        # A hostile grammar (say the regex "(a{1000}){1000}") takes ~0.1 s to build its
        # lexer's first states, and hits llguidance's limits (LIMITS) when its first token is
        # taken. Both happen here, on the request's thread (llguidance lets go of the GIL):
        # the first mask, then a copy taking the first token that mask allows (~5 ms). The
        # step thread never waits on the build, and such a grammar is refused, not run.
        probe = m
        if not m.is_error():
            allowed = np.flatnonzero(_unpack(_bitmask([m], self.vocab_size), self.vocab_size)[0])
            if len(allowed) and not m.is_error():
                probe = m.deep_copy()
                probe.consume_token(int(allowed[0]))
        if probe.is_error():
            error = brief(probe.get_error())
            error = _STOP_REASONS.get(error, error)
            raise ValueError(f"structured_outputs: {params.kind}: {error}")
        return m

    def mask_logits(self, logits: torch.Tensor, rows: Sequence[tuple[int, Any]]) -> torch.Tensor:
        """``logits`` [B, V] with each ``(row, matcher)``'s tokens that its grammar does not
        allow next at -inf (a new tensor; the same one when no row has a matcher)."""
        if not rows:
            return logits
        batch, vocab = logits.shape
        refused = np.zeros((batch, vocab), dtype=np.bool_)
        refused[[r for r, _ in rows]] = _unpack(_bitmask([m for _, m in rows], vocab), vocab) == 0
        # One where() over the batch: ~0.15 ms for 8 x 49,152 here, where a masked_fill_ of
        # the constrained rows' copies took ~0.5 ms.
        refused_t = torch.from_numpy(refused).to(logits.device)
        return torch.where(refused_t, torch.tensor(-np.inf, device=logits.device), logits)


# llguidance states some errors as its parser's stop reason alone: these in words.
_STOP_REASONS = {
    "NoExtension": "no text can match it",
    "NoExtensionBias": "no text can match it",
    "ParserTooComplex": "too complex (over the parser's limits)",
    "LexerTooComplex": "too complex (over the lexer's limits)",
    "InternalError": "the grammar engine failed on it",
}


def _bitmask(matchers: Sequence[Any], vocab: int) -> np.ndarray:
    """Each matcher's next-token bitmask, a row each: [rows, ceil(vocab / 32)] int32."""
    mask = np.full((len(matchers), (vocab + 31) // 32), -1, dtype=np.int32)
    for row, m in zip(mask, matchers, strict=True):  # llguidance lets go of the GIL
        m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
    return mask


def _unpack(bitmask: np.ndarray, vocab: int) -> np.ndarray:
    """A bitmask [rows, words] as [rows, vocab] of 0 / 1: bit t of a row's int32 words is
    token t, so little-endian bytes unpack little-endian."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
    return bits[:, :vocab]
