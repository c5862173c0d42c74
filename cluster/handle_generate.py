"""The Python handle's plain form (``handle.generate.remote(request)``): a request dict
(one ``prompt`` or ``messages``, sampling fields, ``stream``, ``request_id``) becomes a
``GenerateRequest``; a completion or a stream's chunk becomes a dict of text, token ids,
usage and provenance (``kvmesh``)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from pydantic import Field, ValidationError

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest
from kvmesh.cluster.generate_body import Body
from kvmesh.cluster.protocol import ChatMessage
from kvmesh.cluster.request_parsing import describe_errors
from kvmesh.workers.sampling_params import SamplingParams

MAX_REQUEST_ID = 256  # characters of a caller's request_id
_SAMPLING_KEYS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "include_stop_str_in_output",
    "ignore_eos",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "stop_token_ids",
    "skip_special_tokens",
    "cache_salt",
    "allowed_token_ids",
    "bad_words",  # tokenized by ClusterBackend.stream, as the prompt is
    "structured_outputs",  # StructuredOutputsParams' fields, as a dict
)


def parse_request(d: dict[str, Any]) -> GenerateRequest:
    """A handle request dict -> GenerateRequest; ValueError naming the field on bad input."""
    if not isinstance(d, dict):
        raise ValueError("request: must be a dict")
    unknown = set(d) - {"prompt", "messages", "stream", "request_id", *_SAMPLING_KEYS}
    if unknown:
        raise ValueError(f"{sorted(unknown)[0]}: unknown field")
    if ("prompt" in d) == ("messages" in d):
        raise ValueError("prompt: give exactly one of prompt or messages")
    try:  # the types the HTTP routes take for one prompt, checked as strictly
        given = _Input.model_validate({k: d[k] for k in ("prompt", "messages") if k in d})
    except ValidationError as e:
        raise ValueError(describe_errors(e.errors(include_url=False))[0]) from None
    params = SamplingParams(**{k: d[k] for k in _SAMPLING_KEYS if k in d})
    rid = d.get("request_id")
    if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= MAX_REQUEST_ID):
        # It names the request in logs and on the workers: a string, and short.
        raise ValueError(f"request_id: must be a string of 1 to {MAX_REQUEST_ID} characters")
    rid = rid or f"kvmesh-{uuid.uuid4().hex}"
    messages = None if given.messages is None else [m.as_dict() for m in given.messages]
    return GenerateRequest(rid, params, prompt=given.prompt, messages=messages)


class _Input(Body):
    """A handle request's prompt or messages (``parse_request`` checked that one is there)."""

    prompt: str | list[Annotated[int, Field(ge=0)]] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)


def completion_dict(c: Completion) -> dict[str, Any]:
    return {
        "id": c.request_id,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
        "usage": {
            "prompt_tokens": len(c.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "cached_tokens": c.cached_tokens,
        },
        "kvmesh": c.kv.to_dict(),
        "logprobs": c.logprobs,
        "prompt_logprobs": c.prompt_logprobs,
    }


def chunk_dict(c: Chunk) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": c.request_id,
        "text": c.text,
        "token_ids": c.token_ids,
        "finish_reason": c.finish_reason,
    }
    if c.logprobs is not None:
        out["logprobs"] = c.logprobs
    if c.prompt_logprobs is not None:
        out["prompt_logprobs"] = c.prompt_logprobs
    if c.completion is not None:
        full = completion_dict(c.completion)
        out["usage"], out["kvmesh"] = full["usage"], full["kvmesh"]
    return out
