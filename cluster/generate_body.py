"""What both OpenAI generate bodies share (pydantic): the base model (strict, no NaN), the
sampling fields and their conversion to ``SamplingParams`` (``GenerateBody.sampling_params``),
``n``, ``stream_options``, the checks that need no tokens, ``logit_bias``'s keys as token
ids, and vLLM's ``allowed_token_ids`` and ``bad_words`` (tokenized by the caller,
``openai_requests.py``). The two bodies, chat and completions: ``protocol.py``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.cluster.api_error import ApiError, valid
from kvmesh.cluster.field_schemas import (
    ALLOWED_TOKEN_IDS_SCHEMA,
    BAD_WORDS_SCHEMA,
    CACHE_SALT_SCHEMA,
    LOGIT_BIAS_SCHEMA,
    PENALTY_SCHEMA,
    STOP_SCHEMA,
    STOP_TOKEN_IDS_SCHEMA,
    TRUNCATE_PROMPT_TOKENS_SCHEMA,
    schema,
)
from kvmesh.cluster.unsupported_fields import Unsupported
from kvmesh.workers.sampling_params import SamplingParams, brief_repr
from kvmesh.workers.structured_output import StructuredOutputsParams

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Choices in one response: OpenAI's cap on ``n``, and on prompts x n for a completion batch
# (each choice is a request of its own on the workers; the admission limit counts HTTP
# requests, so this bounds what one of them brings).
MAX_CHOICES = 128


def model_not_found(model: str, model_name: str) -> ApiError:
    """The 404 for a model name other than the one served (OpenAI's code for it)."""
    return ApiError(
        404,
        f"model: {brief_repr(model)} does not exist; this server has {model_name!r}",
        param="model",
        code="model_not_found",
    )


def check_model(model: str | None, model_name: str) -> None:
    """A body's ``model``: absent, or the one served (else ``model_not_found``)."""
    if model is not None and model != model_name:
        raise model_not_found(model, model_name)


class Body(BaseModel):
    # No NaN or Infinity (not JSON, though parsers take them) and no 1e400 (parsed as inf).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


_SP = SamplingParams


class StreamOptions(Body):
    include_usage: bool = False


class GenerateBody(Body):
    """Fields both endpoints share; ``None`` means "the default".

    ``logit_bias`` maps token ids, as JSON's string keys, to biases; it, the penalties
    (``repetition_penalty``: vLLM's extension) and vLLM's ``allowed_token_ids`` and
    ``bad_words`` apply as ``workers/penalties.py`` says.
    ``stream_options`` needs ``stream: true`` (OpenAI's 400 too). ``user`` is accepted and
    unused (it asks for nothing).
    """

    # stream_options without stream: true is a 400 (check()); the schema says so too.
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"properties": {"stream": {"const": True}}, "required": ["stream"]},
                {"properties": {"stream_options": {"type": "null"}}},
            ]
        }
    )

    PROMPT_FIELD: ClassVar[str]
    LOGPROBS_FIELD: ClassVar[str]
    # field -> what kvmesh accepts of an OpenAI field it does not implement
    UNSUPPORTED: ClassVar[dict[str, Unsupported]] = {}

    model: str | None = None
    max_tokens: Annotated[int | None, schema("integer", minimum=1)] = Field(
        None, description="At most the context minus the prompt's tokens."
    )
    min_tokens: Annotated[int | None, schema("integer", minimum=0)] = Field(
        None,
        description="vLLM's extension: until this many tokens, no EOS, stop token or stop "
        "string ends the answer; at most max_tokens.",
    )
    temperature: Annotated[
        float | None, schema("number", minimum=0, maximum=_SP.MAX_TEMPERATURE)
    ] = None
    top_p: Annotated[float | None, schema("number", exclusiveMinimum=0, maximum=1)] = None
    # extension (vLLM); -1 means off, as there
    top_k: Annotated[int | None, schema("integer", minimum=-1, maximum=_SP.MAX_TOP_K)] = Field(
        None, description="vLLM's extension: -1 or null for off, else at least 1 (0 is refused)."
    )
    min_p: Annotated[float | None, schema("number", minimum=0, maximum=1)] = Field(
        None, description="vLLM's extension: drop tokens less likely than min_p times the top one."
    )
    seed: Annotated[int | None, schema("integer", minimum=_SP.SEED_MIN, maximum=_SP.SEED_MAX)] = (
        None
    )
    stop: Annotated[str | list[str] | None, STOP_SCHEMA] = None
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM's extension: the text ends with the stop string that ended it."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, schema("integer", nullable=False, minimum=1, maximum=MAX_CHOICES)] = Field(
        1,
        description="Choices per prompt; with a seed, choice i samples with seed + i.",
    )
    ignore_eos: bool = Field(False, description="vLLM's extension: generate past EOS.")
    user: str | None = None  # accepted, unused
    presence_penalty: Annotated[float | None, PENALTY_SCHEMA] = Field(
        None, description="Subtracted from the logit of every token the output has used."
    )
    frequency_penalty: Annotated[float | None, PENALTY_SCHEMA] = Field(
        None, description="Times the count of a token in the output, subtracted from its logit."
    )
    repetition_penalty: Annotated[
        float | None,
        schema("number", exclusiveMinimum=0, maximum=_SP.MAX_REPETITION_PENALTY),
    ] = Field(
        None,
        description="vLLM's extension: divides the positive logits (multiplies the negative "
        "ones) of every token in the prompt or the output; 1 is off.",
    )
    logit_bias: Annotated[dict[str, float] | None, LOGIT_BIAS_SCHEMA] = Field(
        None, description="Token id (a string of digits) -> a bias added to its logit."
    )
    skip_special_tokens: bool | None = Field(
        None,
        description="vLLM's extension: false keeps special tokens (e.g. <|im_start|>) in the "
        "text; the token that ends the answer (EOS, a stop token id) stays out either way.",
    )
    stop_token_ids: Annotated[list[int] | None, STOP_TOKEN_IDS_SCHEMA] = Field(
        None, description="vLLM's extension: token ids that end the answer, as EOS does."
    )
    allowed_token_ids: Annotated[list[int] | None, ALLOWED_TOKEN_IDS_SCHEMA] = Field(
        None,
        description="vLLM's extension: only these token ids of the vocabulary may be chosen "
        "(greedy too); null for any, never empty. Logprobs stay the model's own.",
    )
    bad_words: Annotated[list[str] | None, BAD_WORDS_SCHEMA] = Field(
        None,
        description="vLLM's extension: words never generated. Each is tokenized as it is and "
        "after a space, as a word mid-text is spelled; a one-token "
        "word is never chosen, a longer one's last token not once the answer ends with the "
        "others.",
    )
    truncate_prompt_tokens: Annotated[int | None, TRUNCATE_PROMPT_TOKENS_SCHEMA] = Field(
        None,
        description="vLLM's extension: keep only the prompt's last N tokens (left "
        "truncation; -1: as many as the model's context holds); the prompt's usage and any "
        "echo are of the kept tokens.",
    )
    cache_salt: Annotated[str | None, CACHE_SALT_SCHEMA] = Field(
        None,
        description="vLLM's extension: the request shares cached KV (on any worker) only with "
        "requests of the same salt, so tenants that salt their requests apart cannot tell "
        "from a cache hit's speed what the others sent.",
    )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def default_max_tokens(self, room: int) -> int:
        """max_tokens when the client gave none; ``room`` is what the context has left."""
        return min(room, COMPLETION_DEFAULT_MAX_TOKENS)

    @abstractmethod
    def num_logprobs(self) -> int | None:
        """How many top alternatives to report per token; None for no logprobs (each
        endpoint spells logprobs its own way)."""

    def num_prompt_logprobs(self) -> int | None:
        """The same for each prompt token (completions' echo with logprobs); None: none."""
        return None

    def check(self, model_name: str) -> None:
        """Checks that need no tokens: the model, n, the fields kvmesh does not implement,
        stream_options without stream, and top_logprobs without logprobs."""
        check_model(self.model, model_name)
        if not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n: must be between 1 and {MAX_CHOICES}, got {self.n}", param="n")
        for name, unsupported in self.UNSUPPORTED.items():
            if not unsupported.is_off(getattr(self, name)):
                raise unsupported.error(name)
        keep = self.truncate_prompt_tokens
        if keep is not None and keep != -1 and keep < 1:
            raise ApiError(
                400,
                f"truncate_prompt_tokens: must be -1 (the model's context) or at least 1, got "
                f"{keep}",
                param="truncate_prompt_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400, "stream_options: only allowed with stream: true", param="stream_options"
            )
        self.num_logprobs()

    def sampling_params(
        self,
        prompt_len: int,
        max_model_len: int,
        vocab_size: int,
        bad_words_token_ids: tuple[tuple[int, ...], ...] = (),
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """Validated SamplingParams whose prompt + max_tokens fit the context and whose
        logit_bias and allowed_token_ids name tokens of the vocabulary;
        ``bad_words_token_ids``: the body's bad_words, tokenized; ``structured_outputs``:
        what its structured-output field asks for (``structured_body.py``)."""
        kw: dict[str, Any] = {"ignore_eos": self.ignore_eos}
        for name in (
            "temperature", "top_p", "min_p", "seed", "stop", "min_tokens",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids",
            "cache_salt", "include_stop_str_in_output", "allowed_token_ids", "bad_words",
            "skip_special_tokens",
        ):  # fmt: skip
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.logit_bias is not None:
            kw["logit_bias"] = _token_ids(self.logit_bias, vocab_size)
        if self.top_k is not None and self.top_k != -1:
            kw["top_k"] = self.top_k
        kw["logprobs"] = self.num_logprobs()
        kw["prompt_logprobs"] = self.num_prompt_logprobs()
        kw["bad_words_token_ids"] = bad_words_token_ids
        kw["structured_outputs"] = structured_outputs
        asked, field = self.requested_max_tokens, self.max_tokens_field
        # Sampling fields before lengths; a placeholder max_tokens until the length is known.
        first = asked if asked is not None else max(1, self.min_tokens or 0)
        rename = {"max_tokens": field, "logprobs": self.LOGPROBS_FIELD}
        params = valid(lambda: SamplingParams(max_tokens=first, **kw), rename)
        if any(t >= vocab_size for t in params.allowed_token_ids or ()):
            raise ApiError(
                400,
                f"allowed_token_ids: token ids must be in the vocabulary, [0, {vocab_size})",
                param="allowed_token_ids",
            )
        if prompt_len >= max_model_len:
            raise ApiError(
                400,
                f"{self.PROMPT_FIELD}: {prompt_len} tokens is longer than the context "
                f"({max_model_len} tokens, one kept for the answer)",
                param=self.PROMPT_FIELD,
            )
        if asked is None:
            default = self.default_max_tokens(max_model_len - prompt_len)
            return valid(lambda: replace(params, max_tokens=default), rename)
        if prompt_len + asked > max_model_len:
            raise ApiError(
                400,
                f"{field}: the prompt's {prompt_len} tokens plus {field} {asked} exceed the "
                f"context of {max_model_len} tokens",
                param=field,
            )
        return params

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's token ids as ``truncate_prompt_tokens`` keeps them: the last N (N = the
        model's context for -1), all of them when it is unset or they are fewer."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return ids
        keep = max_model_len if keep == -1 else keep
        return ids[-keep:] if len(ids) > keep else ids

    def per_choice(self, params: SamplingParams) -> list[SamplingParams]:
        """Each of the n choices' params. With a seed, choice i samples with seed + i (as
        vLLM does; wrapped into the seed's range), so the choices differ and each is what a
        request of its own with that seed gives."""
        if params.seed is None:
            return [params] * self.n
        lo, span = _SP.SEED_MIN, _SP.SEED_MAX - _SP.SEED_MIN + 1
        return [replace(params, seed=(params.seed + i - lo) % span + lo) for i in range(self.n)]


def _token_ids(logit_bias: dict[str, float], vocab_size: int) -> dict[int, float]:
    """logit_bias's JSON keys as token ids (ApiError 400 for one that is not an id of the
    vocabulary)."""
    out: dict[int, float] = {}
    for key, bias in logit_bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise ApiError(
                400,
                f"logit_bias: keys must be token ids in [0, {vocab_size}), "
                f"got {brief_repr(key, 20)}",
                param="logit_bias",
            )
        if int(key) in out:
            raise ApiError(400, f"logit_bias: names token {int(key)} twice", param="logit_bias")
        out[int(key)] = bias
    return out
