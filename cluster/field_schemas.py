"""The JSON schemas (OpenAPI) of the OpenAI request fields, with the bounds ``SamplingParams``
enforces: documentation only, they change what ``/openapi.json`` says (and what a client
generator or a fuzzer sends), not what parses; the checks are SamplingParams' own."""

from __future__ import annotations

from typing import Any

from pydantic import WithJsonSchema

from kvmesh.workers.sampling_params import SamplingParams as _SP


def schema(type_: str, nullable: bool = True, **keywords: Any) -> WithJsonSchema:
    """The JSON schema of a field of JSON type ``type_`` with these keywords (bounds), or null
    unless ``nullable`` is False."""
    body = {"type": type_, **keywords}
    return WithJsonSchema({"anyOf": [body, {"type": "null"}]} if nullable else body)


_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": _SP.MAX_STOP_LEN}
STOP_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            _STOP_STRING,
            {"type": "array", "items": _STOP_STRING, "maxItems": _SP.MAX_STOP},
            {"type": "null"},
        ]
    }
)
LOGPROBS_SCHEMA = schema("integer", minimum=0, maximum=_SP.MAX_LOGPROBS)
PENALTY_SCHEMA = schema("number", minimum=-_SP.MAX_PENALTY, maximum=_SP.MAX_PENALTY)
LOGIT_BIAS_SCHEMA = schema(
    "object",
    propertyNames={"pattern": "^[0-9]{1,10}$"},
    additionalProperties={"type": "number", "minimum": -_SP.MAX_BIAS, "maximum": _SP.MAX_BIAS},
    maxProperties=_SP.MAX_LOGIT_BIAS,
)
STOP_TOKEN_IDS_SCHEMA = schema(
    "array",
    items={"type": "integer", "minimum": 0, "maximum": _SP.MAX_TOKEN_ID},
    maxItems=_SP.MAX_STOP_TOKEN_IDS,
)
CACHE_SALT_SCHEMA = schema("string", minLength=1, maxLength=_SP.MAX_CACHE_SALT)
ALLOWED_TOKEN_IDS_SCHEMA = schema(
    "array",
    items={"type": "integer", "minimum": 0, "maximum": _SP.MAX_TOKEN_ID},
    minItems=1,
    maxItems=_SP.MAX_ALLOWED_TOKEN_IDS,
)
# "\S": not only whitespace (a word's leading whitespace is stripped: nothing would be left)
BAD_WORDS_SCHEMA = schema(
    "array",
    items={"type": "string", "minLength": 1, "maxLength": _SP.MAX_BAD_WORD_LEN, "pattern": r"\S"},
    maxItems=_SP.MAX_BAD_WORDS,
)
# vLLM's: -1 (the model's context) or a positive count of the prompt's last tokens to keep.
TRUNCATE_PROMPT_TOKENS_SCHEMA = WithJsonSchema(
    {"anyOf": [{"const": -1}, {"type": "integer", "minimum": 1}, {"type": "null"}]}
)
