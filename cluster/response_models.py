"""The OpenAPI schema of what ``response_shape.ResponseShape`` builds: pydantic models of OpenAI's
response objects (and kvmesh's ``kvmesh`` extra), used to document the routes and, in the
tests, to check that every dict the API sends has exactly this shape."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Out(BaseModel):
    # Forbid: a key the dicts gain and the models lack fails the schema tests.
    model_config = ConfigDict(extra="forbid")


class ErrorInfo(_Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Out):
    """OpenAI's error body, for every 4xx and 5xx."""

    error: ErrorInfo


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(
        description="Prompt tokens not computed: hits in the pool and the tiers, and pulled."
    )


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class KvmeshInfo(_Out):
    """Where the prompt's KV came from (kvmesh's extension)."""

    worker: str
    local_hit_tokens: int
    pulled_tokens: int
    computed_tokens: int
    ttft_ms: float | None
    prefill_worker: str | None = Field(None, description="Absent when none ran.")
    migrations: int = Field(0, description="Times the request moved after losing a worker.")
    host_hit_tokens: int = Field(0, description="Loaded from the worker's host-memory tier.")
    disk_hit_tokens: int = Field(0, description="Loaded from the worker's disk tier.")


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob]
    refusal: str | None


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float | None]  # null for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CalledFunction(_Out):
    name: str
    arguments: str = Field(description="JSON: the arguments, as the model wrote them.")


class ToolCall(_Out):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(_Out):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is tool calls.")
    tool_calls: list[ToolCall] | None = Field(
        None, description='With tools and tool_choice "required" or a named function.'
    )


class ChatChoice(_Out):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str
    kvmesh: KvmeshInfo | None = Field(
        None, description="This choice's, when there are several (the top-level is choice 0's)."
    )


class ChatCompletionResponse(_Out):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kvmesh: KvmeshInfo


class FunctionDelta(_Out):
    name: str | None = Field(None, description="In a call's first delta.")
    arguments: str = Field(description="More of the arguments: joined, the call's own.")


class ToolCallDelta(_Out):
    index: int = Field(description="Which call of the answer.")
    id: str | None = Field(None, description="In a call's first delta.")
    type: Literal["function"] | None = Field(None, description="In a call's first delta.")
    function: FunctionDelta


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(_Out):
    """One server-sent event of a chat stream (``data: {...}``; the last is ``[DONE]``).
    ``usage`` is null until the extra last chunk (no choices) of ``include_usage``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kvmesh: KvmeshInfo | None = Field(
        None, description="On each choice's last chunk (its own) and the usage chunk (choice 0's)."
    )


class CompletionChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str
    kvmesh: KvmeshInfo | None = Field(
        None, description="This choice's, when there are several (the top-level is choice 0's)."
    )


class CompletionResponse(_Out):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kvmesh: KvmeshInfo


class CompletionChunkChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionChunk(_Out):
    """One server-sent event of a completions stream (``data: {...}``; the last is
    ``[DONE]``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None
    kvmesh: KvmeshInfo | None = Field(
        None, description="On each choice's last chunk (its own) and the usage chunk (choice 0's)."
    )


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Out):
    status: Literal["ok"]


class TokenizeResponse(_Out):
    """vLLM's ``/tokenize`` answer."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="With return_token_strs: each token's text.")


class DetokenizeResponse(_Out):
    """vLLM's ``/detokenize`` answer."""

    prompt: str


RESPONSE_MODELS: tuple[type[BaseModel], ...] = (
    ErrorResponse,
    ChatCompletionResponse,
    ChatCompletionChunk,
    CompletionResponse,
    CompletionChunk,
    ModelCard,
    ModelList,
    Health,
    TokenizeResponse,
    DetokenizeResponse,
)
