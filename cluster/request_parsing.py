"""Request bodies parsed into the OpenAI request models (``protocol.py``), and pydantic's
(or FastAPI's) validation errors told as OpenAI's 400: a message and the ``param`` it names.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.generate_body import StreamOptions
from kvmesh.cluster.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TextPart,
    TokenizeRequest,
)
from kvmesh.cluster.structured_body import JsonSchemaFormat, ResponseFormat, StructuredOutputsBody
from kvmesh.cluster.tool_calls import (
    CalledFunction,
    FunctionDefinition,
    FunctionName,
    MessageToolCall,
    NamedToolChoice,
    Tool,
)

_FIELDS = frozenset(
    name
    for model in (
        ChatCompletionRequest,
        CompletionRequest,
        ChatMessage,
        TextPart,
        StreamOptions,
        ResponseFormat,
        JsonSchemaFormat,
        StructuredOutputsBody,
        Tool,
        FunctionDefinition,
        NamedToolChoice,
        FunctionName,
        MessageToolCall,
        CalledFunction,
        TokenizeRequest,
        DetokenizeRequest,
    )
    for name, info in model.model_fields.items()
    for name in (name, info.alias or name)  # errors name a field by its alias ("schema")
)


B = TypeVar("B", bound=BaseModel)


def parse_body(raw: bytes, model: type[B]) -> B:
    """``model`` from a JSON body; ApiError 400 naming the field when it does not parse."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        message, param = describe_errors(e.errors(include_url=False))
        raise ApiError(400, message, param=param) from None


def json_body(model: type[B]) -> Callable[[Request], Awaitable[B]]:
    """A FastAPI dependency: the request body parsed as ``model`` (in a thread, off the event
    loop; a 400 naming the field when it does not parse). The body is whole already: the
    ``LimitBody`` middleware read it."""

    async def read(request: Request) -> B:
        return await asyncio.to_thread(parse_body, await request.body(), model)

    return read


def parse_dict(body: Any, model: type[B]) -> B:
    """``model`` from a Python caller's body (the Serve handle): a dict of what the JSON body
    would hold, checked exactly as that body is."""
    if not isinstance(body, dict):
        raise ApiError(400, f"request body: must be a dict, got {type(body).__name__}")
    try:
        raw = json.dumps(body, allow_nan=False)  # JSON has no NaN or infinity either
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"request body: not JSON: {e}") from None
    return parse_body(raw.encode(), model)


_LOCATIONS = ("query", "path", "header", "cookie")


def describe_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) of the most specific pydantic (or FastAPI request) validation error,
    param like ``messages[0].content``.

    pydantic's ``loc`` also holds union member tags (``str``, ``list[TextPart]``), which are
    not part of the path: only field names and indices are. A value that fits
    none of a union's members gets an error from each; the one with the longest path is
    about the member the value was meant for (content parts with an image part: its
    ``type``, not "should be a valid string"). On a tie, the first. FastAPI's start with
    where the value was (``body``, ``query``, ...).
    """
    if not errors:
        return "request body: invalid", None
    described = [_describe(err) for err in errors]
    return max(described, key=lambda d: len(d[1] or ""))  # max keeps the first of equals


def _describe(err: Any) -> tuple[str, str | None]:
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "json_invalid":
        return f"request body is not valid JSON: {err.get('msg', '')}", None
    if loc and loc[0] in _LOCATIONS and len(loc) > 1:
        return f"{loc[1]}: {err.get('msg', 'invalid')}", str(loc[1])
    if loc and loc[0] == "body":
        loc = loc[1:]
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part in _FIELDS:
            param += f".{part}" if param else part
        # else a union member's tag: not part of the path
    if not param:
        return f"request body: {err.get('msg', 'invalid')}", None
    return f"{param}: {err.get('msg', 'invalid')}", param
