"""OpenAI request bodies (pydantic) and their checks.

Requests are parsed in strict mode: OpenAI rejects ``"max_tokens": "10"``, so do we, rather
than coerce. Fields OpenAI does not define are ignored, because clients send vendor extras;
those it defines but kvmesh does not implement are refused unless they ask for nothing
(``unsupported_fields.py``). Ranges of the sampling fields (max_tokens >= 1, 0 < top_p <= 1,
...) are checked by ``SamplingParams`` alone, so the Python API and HTTP give the same
messages; the models only *document* them in their JSON schema (OpenAPI), from the same
constants (``field_schemas.py``). Errors: ``api_error.py``; responses: ``response_shape.py``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.cluster.api_error import ApiError, valid
from kvmesh.cluster.field_schemas import (
    LOGIT_BIAS_SCHEMA,
    LOGPROBS_SCHEMA,
    PENALTY_SCHEMA,
    STOP_SCHEMA,
    schema,
)
from kvmesh.cluster.unsupported_fields import (
    EmptyList,
    NoneChoice,
    Unsupported,
    is_empty,
    is_none_choice,
    only,
    unsupported_doc,
)
from kvmesh.workers.chat import ROLES
from kvmesh.workers.sampling_params import SamplingParams

T = TypeVar("T")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Choices in one response: OpenAI's cap on ``n``, and on prompts x n for a completion batch
# (each choice is a request of its own on the workers; the admission limit counts HTTP
# requests, so this bounds what one of them brings).
MAX_CHOICES = 128


def model_not_found(model: str, model_name: str) -> ApiError:
    """The 404 for a model name other than the one served (OpenAI's code for it)."""
    return ApiError(
        404,
        f"model: {model!r} does not exist; this server has {model_name!r}",
        param="model",
        code="model_not_found",
    )


class _Body(BaseModel):
    # No NaN or Infinity (not JSON, though parsers take them) and no 1e400 (parsed as inf).
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


_SP = SamplingParams


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    # OpenAI's types; json_schema's own fields are not read: only "text" is served.
    type: Literal["text", "json_object", "json_schema"]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart]

    def as_dict(self) -> dict[str, str]:
        text = self.content
        if not isinstance(text, str):  # content parts, as newer clients send them
            text = "\n".join(p.text for p in text)
        return {"role": self.role, "content": text}


class _GenerateBody(_Body):
    """Fields both endpoints share; ``None`` means "the default".

    ``logit_bias`` maps token ids, as JSON's string keys, to biases; it and the penalties
    (``repetition_penalty``: vLLM's extension) apply as ``workers/penalties.py`` says.
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
        if self.model is not None and self.model != model_name:
            raise model_not_found(self.model, model_name)
        if not 1 <= self.n <= MAX_CHOICES:
            raise ApiError(400, f"n: must be between 1 and {MAX_CHOICES}, got {self.n}", param="n")
        for name, unsupported in self.UNSUPPORTED.items():
            if not unsupported.is_off(getattr(self, name)):
                raise unsupported.error(name)
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400, "stream_options: only allowed with stream: true", param="stream_options"
            )
        self.num_logprobs()

    def sampling_params(
        self, prompt_len: int, max_model_len: int, vocab_size: int
    ) -> SamplingParams:
        """Validated SamplingParams whose prompt + max_tokens fit the context and whose
        logit_bias names tokens of the vocabulary."""
        kw: dict[str, Any] = {"ignore_eos": self.ignore_eos}
        for name in (
            "temperature", "top_p", "min_p", "seed", "stop", "min_tokens",
            "presence_penalty", "frequency_penalty", "repetition_penalty",
        ):  # fmt: skip
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if self.logit_bias is not None:
            kw["logit_bias"] = _token_ids(self.logit_bias, vocab_size)
        if self.top_k is not None and self.top_k != -1:
            kw["top_k"] = self.top_k
        kw["logprobs"] = self.num_logprobs()
        kw["prompt_logprobs"] = self.num_prompt_logprobs()
        asked, field = self.requested_max_tokens, self.max_tokens_field
        # Sampling fields before lengths; a placeholder max_tokens until the length is known.
        first = asked if asked is not None else max(1, self.min_tokens or 0)
        rename = {"max_tokens": field, "logprobs": self.LOGPROBS_FIELD}
        params = valid(lambda: SamplingParams(max_tokens=first, **kw), rename)
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
            shown = key if len(key) <= 20 else f"{key[:17]}..."
            raise ApiError(
                400,
                f"logit_bias: keys must be token ids in [0, {vocab_size}), got {shown!r}",
                param="logit_bias",
            )
        if int(key) in out:
            raise ApiError(400, f"logit_bias: names token {int(key)} twice", param="logit_bias")
        out[int(key)] = bias
    return out


class ChatCompletionRequest(_GenerateBody):
    """OpenAI's chat completion request.

    Besides the shared fields (``_GenerateBody``), OpenAI's chat fields kvmesh does not
    implement are accepted only at a value that asks for nothing, else a 400 naming the field:
    ``response_format`` only ``{"type": "text"}`` or null (no JSON mode, no structured
    outputs); ``tools`` and the deprecated ``functions`` only ``[]`` or null, ``tool_choice``
    and ``function_call`` only ``"none"`` or null (no tool calls: OpenAI and vLLM refuse a
    tool_choice without tools too). ``parallel_tool_calls`` is accepted at any boolean: with
    no tools it asks for nothing.
    """

    PROMPT_FIELD = "messages"
    LOGPROBS_FIELD = "top_logprobs"
    UNSUPPORTED = _GenerateBody.UNSUPPORTED | {
        "response_format": Unsupported(
            "JSON mode or structured outputs",
            '{"type": "text"}',
            lambda v: v is None or v.type == "text",
        ),
        "tools": Unsupported("tool calls", "[]", is_empty),
        "tool_choice": Unsupported("tool calls", '"none"', is_none_choice),
        "functions": Unsupported("function calls", "[]", is_empty),
        "function_call": Unsupported("function calls", '"none"', is_none_choice),
    }
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: Annotated[int | None, schema("integer", minimum=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, LOGPROBS_SCHEMA] = Field(
        None, description="Needs logprobs: true."
    )
    response_format: Annotated[
        ResponseFormat | None,
        only(
            {
                "type": "object",
                "properties": {"type": {"const": "text"}},
                "required": ["type"],
            }
        ),
    ] = Field(None, description=unsupported_doc('{"type": "text"}'))
    tools: EmptyList = Field(None, description=unsupported_doc("[]"))
    tool_choice: NoneChoice = Field(None, description=unsupported_doc('"none"'))
    parallel_tool_calls: bool | None = Field(
        None, description="Accepted, unused: kvmesh takes no tools."
    )
    functions: EmptyList = Field(None, description=unsupported_doc("[]", " Deprecated by OpenAI."))
    function_call: NoneChoice = Field(
        None, description=unsupported_doc('"none"', " Deprecated by OpenAI.")
    )

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_tokens_field(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    def default_max_tokens(self, room: int) -> int:
        return room  # OpenAI's chat default: as long as the context allows

    def message_dicts(self) -> list[dict[str, str]]:
        return [m.as_dict() for m in self.messages]


class CompletionRequest(_GenerateBody):
    """OpenAI's (legacy) completion request.

    Besides the shared fields (``_GenerateBody``), OpenAI's completion fields kvmesh does not
    implement are accepted only at a value that asks for nothing, else a 400 naming the field:
    ``best_of`` only 1 or null (below 1 is a 400 for the range), ``suffix`` only null or
    ``""`` (no insertion).
    """

    PROMPT_FIELD = "prompt"
    LOGPROBS_FIELD = "logprobs"
    UNSUPPORTED = _GenerateBody.UNSUPPORTED | {
        "best_of": Unsupported("best_of above 1", "1", lambda v: v is None or v == 1),
        "suffix": Unsupported("suffix (insertion)", '""', is_empty),
    }
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description=f"Text or token ids, or a batch of either: prompts x n at most {MAX_CHOICES}."
    )
    logprobs: Annotated[int | None, LOGPROBS_SCHEMA] = None
    max_tokens: Annotated[int | None, schema("integer", minimum=0)] = Field(
        None,
        description="At most the context minus the prompt's tokens. 0 only with echo: the "
        "prompt (and its logprobs) without a completion, as vLLM does.",
    )
    echo: bool | None = Field(
        None,
        description="Each choice's text starts with its prompt's; with logprobs, so do its "
        "logprobs (the prompt's first token has null ones). The prompt is then computed "
        "again, not taken from the cache: cached KV carries no logits.",
    )
    best_of: Annotated[Annotated[int, Field(ge=1)] | None, only({"const": 1})] = Field(
        None, description=unsupported_doc("1")
    )
    suffix: Annotated[str | None, only({"const": ""})] = Field(
        None, description=unsupported_doc('""')
    )

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt and its logprobs, no completion."""
        return bool(self.echo) and self.max_tokens == 0

    @property
    def requested_max_tokens(self) -> int | None:
        # The engine samples once after any prompt: one token, generated and not shown.
        return 1 if self.prompt_only else self.max_tokens

    def check(self, model_name: str) -> None:
        super().check(model_name)
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(
                400, "max_tokens: must be at least 1 (0 only with echo: true)", param="max_tokens"
            )

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids: a batch, or one prompt as a batch of one.
        Their choices (n each) are at most MAX_CHOICES, else a 400."""
        p = self.prompt
        batch = p if isinstance(p, list) and p and isinstance(p[0], str | list) else [p]
        if len(batch) * self.n > MAX_CHOICES:
            raise ApiError(
                400,
                f"prompt: {len(batch)} prompts with n={self.n} make {len(batch) * self.n} "
                f"choices; at most {MAX_CHOICES}",
                param="prompt",
            )
        return batch  # type: ignore[return-value]


REQUEST_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionRequest, CompletionRequest)
