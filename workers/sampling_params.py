"""Sampling parameters, validated once when a request is made.

Every field is bounded here, so the Python API, the Ray Serve handle and HTTP refuse the same
values with the same message ("field: why, got value"). The caps, and why:

- ``temperature``: a finite number in [0, 2] (OpenAI's range). 0 is greedy; a positive value
  below 0.01 samples at 0.01, as vLLM does (smaller ones overflow the scaled logits).
- ``top_p``: a finite number in (0, 1]; below 1e-6 it acts as 1e-6 (the likeliest token),
  since a float32 that rounds to 0 would keep no token at all.
- ``min_p``: a finite number in [0, 1] (0 is off): tokens less likely than min_p times the
  likeliest one are not drawn (vLLM's; greedy is unaffected).
- ``top_k``: None (off) or an integer in [1, 2**20]; a top_k at or above the vocabulary size
  keeps every token. 2**20 is above any vocabulary in use.
- ``seed``: None or a 64-bit signed integer (vLLM's range; what ``torch.Generator`` takes).
- ``stop``: at most 16 strings of 1 to 256 characters (OpenAI allows 4; vLLM has no cap).
- ``stop_token_ids``: at most 256 ids, each in [0, 2**31).
- ``logprobs``: None or an integer in [0, 20] (OpenAI's ``top_logprobs`` range).
- ``prompt_logprobs``: the same range: each prompt token's logprob and the top N at its
  position (vLLM's; the first token has none). The request then computes its whole prompt:
  a prefix hit has KV but no logits (vLLM does the same).
- ``max_tokens``: an integer >= 1; the engine checks prompt + max_tokens against the context.
- ``min_tokens``: an integer in [0, max_tokens]: until that many tokens, EOS and
  ``stop_token_ids`` are never chosen and no stop string counts (vLLM's).
- ``presence_penalty``, ``frequency_penalty``: finite numbers in [-2, 2] (OpenAI's range).
- ``repetition_penalty``: a finite number in (0, 2] (1 is off; vLLM only asks for > 0, but
  past 2 a model's every seen token is all but banned).
- ``cache_salt``: None or a string of 1 to 1,024 characters (vLLM's; not a sampling knob, but
  it travels with the params to every worker that hashes the request's blocks): the request's
  blocks hash in a namespace of that salt's (``block_hash.cache_namespace``), so it shares
  cached KV only with requests of the same salt.
- ``logit_bias``: at most 1,024 token ids, each in [0, 2**31), with biases in [-100, 100]
  (OpenAI's range); the engine checks the ids against the vocabulary.
- ``allowed_token_ids``: None (every token), or 1 to 4,096 ids in [0, 2**31) (vLLM's; it
  refuses an empty list too: nothing could be chosen); the engine checks the vocabulary.
  One-token bad words that ban every one of them are refused as well (and, by the engine,
  EOS and stop tokens that do under ``min_tokens``).
- ``bad_words``: at most 128 words (vLLM's default cap) of 1 to 256 characters, not only
  whitespace (vLLM strips a word's leading whitespace: nothing would be left).
- ``bad_words_token_ids``: the words' token id sequences (``bad_words.py``), filled where the
  request's text is tokenized, or given directly: at most 256 non-empty sequences (a word and
  its spaced variant) of 4,096 ids in all, each in [0, 2**31); the engine checks the
  vocabulary.
- ``structured_outputs``: None, or a ``StructuredOutputsParams`` (or a dict of its fields):
  the text held to a JSON schema, a regex, a choice or a grammar (``structured_output.py``,
  which bounds and checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvmesh.workers.structured_output import StructuredOutputsParams


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, as in vLLM.

    ``temperature == 0`` is greedy. ``top_k=None`` and ``top_p=1.0`` disable those filters.
    ``seed`` makes one request's sampling reproducible whatever else is in its batch.
    ``stop`` strings are cut from the text (kept with ``include_stop_str_in_output``);
    ``stop_token_ids`` end the request like EOS, and like EOS the token that ends it is not in
    the text (unless ``include_stop_str_in_output``: vLLM's). ``skip_special_tokens=False``
    keeps special tokens (``<|im_start|>``, ...) in the text.
    ``logit_bias`` ({token id: bias}, or (id, bias) pairs) and the penalties change the
    logits every token is chosen from; ``allowed_token_ids`` (only these may be chosen) and
    ``bad_words`` (never generated) mask them first (penalties.py says how). ``bad_words``
    reach the engine's step as ``bad_words_token_ids``, which the API layer (or, for the
    Python API, ``LLMEngine.make_request``) fills with the tokenizer (bad_words.py).
    ``structured_outputs`` holds the text to a JSON schema, a regex, a choice or a grammar
    (structured_output.py); its mask comes before all of these.
    Out-of-range values raise ValueError naming the field (bounds: the module docstring).
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False  # the text ends with the stop string (vLLM's)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # vLLM's: False keeps special tokens in the text
    logprobs: int | None = None  # log-probabilities of each sampled token and the top N
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs; a {token id: bias} dict is taken too.
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    cache_salt: str | None = None
    # vLLM's: only these token ids may be chosen (None: any); never empty.
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's: words never generated; a lone string is one word.
    bad_words: tuple[str, ...] = field(default_factory=tuple)
    # bad_words as token id sequences (bad_words.py), what the step applies; vLLM's private
    # ``_bad_words_token_ids``, filled where the request's text is tokenized.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = field(default_factory=tuple)
    # vLLM's: the text held to a JSON schema, a regex, a choice or a grammar.
    structured_outputs: StructuredOutputsParams | None = None

    MAX_TEMPERATURE = 2.0
    MIN_SAMPLING_TEMPERATURE = 0.01  # vLLM's floor for a positive temperature
    MIN_TOP_P = 1e-6
    MAX_TOP_K = 1 << 20
    SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
    MAX_STOP = 16
    MAX_STOP_LEN = 256
    MAX_STOP_TOKEN_IDS = 256
    MAX_TOKEN_ID = (1 << 31) - 1
    MAX_LOGPROBS = 20
    MAX_PENALTY = 2.0  # presence and frequency: OpenAI's [-2, 2]
    MAX_REPETITION_PENALTY = 2.0
    MAX_LOGIT_BIAS = 1024
    MAX_BIAS = 100.0
    MAX_CACHE_SALT = 1024
    MAX_ALLOWED_TOKEN_IDS = 4096
    MAX_BAD_WORDS = 128  # vLLM's default VLLM_MAX_NUM_BAD_WORDS
    MAX_BAD_WORD_LEN = 256
    MAX_BAD_WORDS_TOKENS = 4096  # in all the sequences of bad_words_token_ids

    def __post_init__(self) -> None:
        # Accept lists (and a lone string for stop or bad_words) as vLLM users write them.
        for name in ("stop", "bad_words"):
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, (getattr(self, name),))
        for name in ("stop", "stop_token_ids", "bad_words", "bad_words_token_ids"):
            value = getattr(self, name)
            if value is None or isinstance(value, list | tuple):
                object.__setattr__(self, name, tuple(value or ()))
        if self.logit_bias is None or isinstance(self.logit_bias, dict):
            bias = self.logit_bias or {}
            object.__setattr__(self, "logit_bias", tuple(bias.items()))
        elif isinstance(self.logit_bias, list | tuple):
            pairs = (tuple(x) if isinstance(x, list) else x for x in self.logit_bias)
            object.__setattr__(self, "logit_bias", tuple(pairs))
        if isinstance(self.allowed_token_ids, list):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        seqs = self.bad_words_token_ids
        if isinstance(seqs, tuple):
            object.__setattr__(
                self,
                "bad_words_token_ids",
                tuple(tuple(x) if isinstance(x, list) else x for x in seqs),
            )
        if isinstance(self.structured_outputs, dict):
            try:
                spec = StructuredOutputsParams(**self.structured_outputs)
            except TypeError:
                raise ValueError(
                    "structured_outputs: takes json, regex, choice, grammar, json_object and "
                    "disable_any_whitespace"
                ) from None
            object.__setattr__(self, "structured_outputs", spec)
        self.validate()
        if 0 < self.temperature < self.MIN_SAMPLING_TEMPERATURE:
            object.__setattr__(self, "temperature", self.MIN_SAMPLING_TEMPERATURE)
        if self.top_p < self.MIN_TOP_P:
            object.__setattr__(self, "top_p", self.MIN_TOP_P)

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {brief_repr(getattr(self, name))}")

        if not _is_int(self.max_tokens):
            raise bad("max_tokens", "must be an integer")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise bad("min_tokens", f"must be an integer in [0, max_tokens {self.max_tokens}]")
        # Comparisons, not math.isfinite: they also refuse NaN and ints too large for a float.
        if not (_is_number(self.temperature) and 0 <= self.temperature <= self.MAX_TEMPERATURE):
            raise bad("temperature", f"must be a finite number in [0, {self.MAX_TEMPERATURE:g}]")
        if not (_is_number(self.top_p) and 0 < self.top_p <= 1):
            raise bad("top_p", "must be a finite number in (0, 1]")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise bad("min_p", "must be a finite number in [0, 1]")
        if self.top_k is not None and not (
            _is_int(self.top_k) and 1 <= self.top_k <= self.MAX_TOP_K
        ):
            raise bad("top_k", f"must be an integer in [1, {self.MAX_TOP_K}] (or None to disable)")
        if self.seed is not None and not (
            _is_int(self.seed) and self.SEED_MIN <= self.seed <= self.SEED_MAX
        ):
            raise bad("seed", "must be a 64-bit signed integer, in [-2**63, 2**63 - 1]")
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not (
            _is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}]")
        if not isinstance(self.stop, tuple) or len(self.stop) > self.MAX_STOP:
            raise bad("stop", f"must be a string or a list of at most {self.MAX_STOP} strings")
        if not all(isinstance(s, str) and 0 < len(s) <= self.MAX_STOP_LEN for s in self.stop):
            raise bad(
                "stop", f"must be non-empty strings of at most {self.MAX_STOP_LEN} characters"
            )
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > (
            self.MAX_STOP_TOKEN_IDS
        ):
            raise bad("stop_token_ids", f"must be a list of at most {self.MAX_STOP_TOKEN_IDS} ids")
        if not all(_is_int(t) and 0 <= t <= self.MAX_TOKEN_ID for t in self.stop_token_ids):
            raise bad("stop_token_ids", f"must be integers in [0, {self.MAX_TOKEN_ID}]")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "must be a boolean")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -self.MAX_PENALTY <= value <= self.MAX_PENALTY):
                raise bad(name, f"must be a finite number in [-{self.MAX_PENALTY:g}, "
                                f"{self.MAX_PENALTY:g}]")  # fmt: skip
        if not (
            _is_number(self.repetition_penalty)
            and 0 < self.repetition_penalty <= self.MAX_REPETITION_PENALTY
        ):
            raise bad(
                "repetition_penalty",
                f"must be a finite number in (0, {self.MAX_REPETITION_PENALTY:g}] (1 is off)",
            )
        self._validate_logit_bias(bad)
        self._validate_token_lists(bad)
        spec = self.structured_outputs
        if spec is not None and not isinstance(spec, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams, a dict or None")
        if self.cache_salt is not None and not (
            isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= self.MAX_CACHE_SALT
        ):
            raise bad(
                "cache_salt", f"must be a string of 1 to {self.MAX_CACHE_SALT} characters or None"
            )

    def _validate_logit_bias(self, bad: Callable[[str, str], ValueError]) -> None:
        pairs = self.logit_bias
        if not (
            isinstance(pairs, tuple)
            and all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs)
        ):
            raise bad("logit_bias", "must be a {token id: bias} mapping or (id, bias) pairs")
        if len(pairs) > self.MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"must map at most {self.MAX_LOGIT_BIAS} token ids to biases")
        if not all(_is_int(t) and 0 <= t <= self.MAX_TOKEN_ID for t, _ in pairs):
            raise bad("logit_bias", f"token ids must be integers in [0, {self.MAX_TOKEN_ID}]")
        if len({t for t, _ in pairs}) != len(pairs):
            raise bad("logit_bias", "names a token id twice")
        if not all(_is_number(b) and -self.MAX_BIAS <= b <= self.MAX_BIAS for _, b in pairs):
            raise bad("logit_bias", f"biases must be finite numbers in [-{self.MAX_BIAS:g}, "
                                    f"{self.MAX_BIAS:g}]")  # fmt: skip

    def _validate_token_lists(self, bad: Callable[[str, str], ValueError]) -> None:
        """allowed_token_ids, bad_words and bad_words_token_ids."""
        allowed, most = self.allowed_token_ids, self.MAX_ALLOWED_TOKEN_IDS
        if allowed is not None:
            if not isinstance(allowed, tuple) or len(allowed) > most:
                raise bad("allowed_token_ids", f"must be a list of at most {most} token ids")
            if not allowed:
                raise bad("allowed_token_ids", "must not be empty: no token could be chosen "
                                               "(None allows every token)")  # fmt: skip
            if not all(_is_int(t) and 0 <= t <= self.MAX_TOKEN_ID for t in allowed):
                raise bad("allowed_token_ids", f"must be integers in [0, {self.MAX_TOKEN_ID}]")
        words = self.bad_words
        if not isinstance(words, tuple) or len(words) > self.MAX_BAD_WORDS:
            raise bad("bad_words", f"must be a list of at most {self.MAX_BAD_WORDS} strings")
        if not all(isinstance(w, str) and w.strip() and len(w) <= self.MAX_BAD_WORD_LEN
                   for w in words):  # fmt: skip
            raise bad("bad_words", f"must be strings of 1 to {self.MAX_BAD_WORD_LEN} "
                                   "characters, not only whitespace")  # fmt: skip
        seqs = self.bad_words_token_ids
        if not (isinstance(seqs, tuple) and all(isinstance(s, tuple) and s for s in seqs)):
            raise bad("bad_words_token_ids", "must be a list of non-empty token id lists")
        if len(seqs) > 2 * self.MAX_BAD_WORDS or sum(map(len, seqs)) > self.MAX_BAD_WORDS_TOKENS:
            raise bad("bad_words_token_ids", f"must be at most {2 * self.MAX_BAD_WORDS} lists "
                      f"of {self.MAX_BAD_WORDS_TOKENS} token ids in all")  # fmt: skip
        if not all(_is_int(t) and 0 <= t <= self.MAX_TOKEN_ID for s in seqs for t in s):
            raise bad("bad_words_token_ids", f"must be integers in [0, {self.MAX_TOKEN_ID}]")
        if allowed and set(allowed) <= {s[0] for s in seqs if len(s) == 1}:
            raise bad("allowed_token_ids", "bad_words ban every one of them: no token could "
                                           "be chosen")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """Whether a logit bias, a penalty, ``min_tokens``, ``allowed_token_ids`` or bad words
        change the logits (penalties.py)."""
        return bool(
            self.allowed_token_ids is not None
            or self.bad_words_token_ids
            or self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def brief_repr(value: object, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: a message never echoes a huge value back."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str()
        return "a very large integer"
    return text if len(text) <= limit else f"{text[: limit - 3]}..."
