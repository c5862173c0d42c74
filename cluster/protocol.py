"""OpenAI request bodies (pydantic) and their checks.

Requests are parsed in strict mode: OpenAI rejects ``"max_tokens": "10"``, so do we, rather
than coerce. Fields OpenAI does not define are ignored, because clients send vendor extras;
those it defines but kvmesh does not implement are refused unless they ask for nothing
(``unsupported_fields.py``). Ranges of the sampling fields (max_tokens >= 1, 0 < top_p <= 1,
...) are checked by ``SamplingParams`` alone, so the Python API and HTTP give the same
messages; the models only *document* them in their JSON schema (OpenAPI), from the same
constants (``field_schemas.py``). The fields both bodies share: ``generate_body.py``. Errors:
``api_error.py``; responses: ``response_shape.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.field_schemas import LOGPROBS_SCHEMA, schema
from kvmesh.cluster.generate_body import MAX_CHOICES, Body, GenerateBody
from kvmesh.cluster.structured_body import StructuredOutputFields
from kvmesh.cluster.tool_calls import (
    MAX_TOOLS,
    TOOLS_NEED_A_CHOICE,
    MessageToolCall,
    Tool,
    ToolCalling,
    ToolChoice,
    tool_calling,
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
from kvmesh.cluster.vllm_extras import ChatVllmExtras, VllmExtras
from kvmesh.workers.chat import ROLES
from kvmesh.workers.structured_output import StructuredOutputsParams


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart] | None = Field(
        None, description="Absent or null only in an assistant's message that has tool_calls."
    )
    tool_calls: list[MessageToolCall] | None = Field(
        None, description="An assistant's earlier calls: they go to the chat template."
    )
    tool_call_id: str | None = Field(
        None,
        description="Required in a tool's message, absent in others: the call it answers "
        "(to the chat template).",
    )

    def as_dict(self) -> dict[str, Any]:
        text = self.content
        if isinstance(text, list):  # content parts, as newer clients send them
            text = "\n".join(p.text for p in text)
        out: dict[str, Any] = {"role": self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(GenerateBody, StructuredOutputFields, VllmExtras, ChatVllmExtras):
    """OpenAI's chat completion request.

    Besides the shared fields (``GenerateBody``), OpenAI's chat fields kvmesh does not
    implement are accepted only at a value that asks for nothing, else a 400 naming the field:
    the deprecated ``functions`` only ``[]`` or null, ``function_call`` only ``"none"`` or
    null. ``tools`` with ``tool_choice`` "required" or a named function are served by
    structured outputs, "auto" is refused (``tool_calls.py``). vLLM's extensions kvmesh does
    not implement: the same (``vllm_extras.py``). vLLM's ``add_generation_prompt`` and
    ``continue_final_message`` are served (the chat template's own options).
    """

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [GenerateBody.model_config["json_schema_extra"], TOOLS_NEED_A_CHOICE]
        }
    )
    PROMPT_FIELD = "messages"
    LOGPROBS_FIELD = "top_logprobs"
    UNSUPPORTED = (
        GenerateBody.UNSUPPORTED
        | VllmExtras.VLLM_UNSUPPORTED
        | ChatVllmExtras.VLLM_UNSUPPORTED
        | {
            "functions": Unsupported("function calls", "[]", is_empty),
            "function_call": Unsupported("function calls", '"none"', is_none_choice),
        }
    )
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = Field(
        True,
        description="vLLM's extension: end the prompt with the assistant turn's start (the "
        "chat template's).",
    )
    continue_final_message: bool = Field(
        False,
        description="vLLM's extension: leave the last message open, so the answer goes on "
        "with it (a reply begun for the model); needs add_generation_prompt: false.",
    )
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: Annotated[int | None, schema("integer", minimum=1)] = None
    logprobs: bool = False
    top_logprobs: Annotated[int | None, LOGPROBS_SCHEMA] = Field(
        None, description="Needs logprobs: true."
    )
    tools: list[Tool] | None = Field(
        None, max_length=MAX_TOOLS, description="Functions the model may call."
    )
    tool_choice: ToolChoice = Field(
        None,
        description='"required" (one call or more), a named function (one call of it), '
        '"none" (no call; the tools still go to the chat template). "auto", the default '
        "with tools, is refused: kvmesh has no parser of free-text tool calls.",
    )
    parallel_tool_calls: bool | None = Field(
        None, description='With "required": false allows one call only.'
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

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tool_calling(self) -> ToolCalling | None:
        """What the tools ask of the answer (None: no calls); ApiError 400 naming the field."""
        return tool_calling(self.tools, self.tool_choice, self.parallel_tool_calls)

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The structured-output fields' constraint, or the tool calls' (``tool_calls.py``);
        both are a 400."""
        calling = self.tool_calling()
        asked = super().structured_outputs_params()
        if calling is None:
            return asked
        if asked is not None:
            raise ApiError(
                400,
                "tool_choice: tool calls are structured outputs of their own; send no other",
                param="tool_choice",
            )
        return calling.structured_outputs()


class CompletionRequest(GenerateBody, StructuredOutputFields, VllmExtras):
    """OpenAI's (legacy) completion request.

    Besides the shared fields (``GenerateBody``), OpenAI's completion fields kvmesh does not
    implement are accepted only at a value that asks for nothing, else a 400 naming the field:
    ``best_of`` only 1 or null (below 1 is a 400 for the range), ``suffix`` only null or
    ``""`` (no insertion); vLLM's extensions kvmesh does not implement the same way
    (``vllm_extras.py``).
    """

    PROMPT_FIELD = "prompt"
    LOGPROBS_FIELD = "logprobs"
    UNSUPPORTED = (
        GenerateBody.UNSUPPORTED
        | VllmExtras.VLLM_UNSUPPORTED
        | {
            "best_of": Unsupported("best_of above 1", "1", lambda v: v is None or v == 1),
            "suffix": Unsupported("suffix (insertion)", '""', is_empty),
        }
    )
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


class TokenizeRequest(Body):
    """vLLM's ``/tokenize`` body (``tokenize_api.py``): one of ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = Field(None, description="A completion prompt's text.")
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = Field(True, description="As chat's (vLLM's extension).")
    continue_final_message: bool = Field(False, description="As chat's (vLLM's extension).")
    tools: list[Tool] | None = Field(
        None, max_length=MAX_TOOLS, description="As chat's: they go to the chat template."
    )
    add_special_tokens: bool | None = Field(
        None,
        description="Only what generating does: true for a prompt, false for messages "
        "(the chat template has them).",
    )
    return_token_strs: bool = Field(False, description="Each token's own text too.")


class DetokenizeRequest(Body):
    """vLLM's ``/detokenize`` body (``tokenize_api.py``)."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="Token ids of the vocabulary.")


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
)
