"""An OpenAI request body, validated, as the backend requests of its choices and the shape of
its response: ``chat_choices`` and ``completion_choices``, shared by the HTTP routes
(``openai_api.py``) and the Python handle (``serve_app.py``), so both check and number
alike. Tokenizing (the prompts, and vLLM's ``bad_words`` once per body, so the workers get
their token ids), the chat template and compiling a structured-output grammar (to check it)
run in a worker thread (``asyncio.to_thread``): they
are CPU work the event loop, where /health and every stream run, must not wait on."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Protocol

import jinja2

from kvmesh.cluster.api_error import ApiError, valid
from kvmesh.cluster.backend import Backend, GenerateRequest
from kvmesh.cluster.generate_body import GenerateBody
from kvmesh.cluster.generation import choice_id
from kvmesh.cluster.protocol import ChatCompletionRequest, CompletionRequest
from kvmesh.cluster.response_shape import Echo, ResponseShape
from kvmesh.cluster.tool_calls import Tool, template_tools
from kvmesh.workers.sampling_params import SamplingParams

Choices = tuple[list[GenerateRequest], ResponseShape]


async def chat_choices(backend: Backend, body: ChatCompletionRequest, model_name: str) -> Choices:
    """A chat body's choices (ApiError 400 when the model, template or sampling is wrong)."""
    body.check(model_name)
    messages = body.message_dicts()
    ids = await asyncio.to_thread(chat_ids, backend, messages, body)
    ids = body.truncated(ids, backend.max_model_len)
    bad_words = await _bad_words_token_ids(backend, body)
    structured = await asyncio.to_thread(body.structured_outputs_params)
    params = body.sampling_params(
        len(ids), backend.max_model_len, backend.vocab_size, bad_words, structured
    )
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    choices = body.per_choice(params)
    reqs = _choice_requests(rid, 0, body.n, choices, messages=messages, prompt_ids=ids)
    shape = ResponseShape(
        "chat", rid, model_name, body.num_logprobs(), body.n, tools=body.tool_calling()
    )
    return reqs, shape


async def completion_choices(backend: Backend, body: CompletionRequest, model_name: str) -> Choices:
    """A completions body's choices: ``n`` per prompt, prompt by prompt (OpenAI's order)."""
    body.check(model_name)
    prompts = body.prompts()
    rid = f"cmpl-{uuid.uuid4().hex}"
    reqs: list[GenerateRequest] = []
    echo: list[Echo] = []
    total = len(prompts) * body.n
    bad_words = await _bad_words_token_ids(backend, body)
    structured = await asyncio.to_thread(body.structured_outputs_params)
    for prompt in prompts:  # every prompt checked before any runs: a bad one runs none
        whole = await asyncio.to_thread(valid, lambda p=prompt: backend.tokenize(p))
        ids = body.truncated(whole, backend.max_model_len)
        params = body.sampling_params(
            len(ids), backend.max_model_len, backend.vocab_size, bad_words, structured
        )
        choices = body.per_choice(params)
        reqs += _choice_requests(rid, len(reqs), total, choices, prompt=prompt, prompt_ids=ids)
        if body.echo:  # token ids, or a truncated prompt, echo as the text they decode to
            kept = isinstance(prompt, str) and ids is whole
            text = prompt if kept else await asyncio.to_thread(backend.decode, ids)
            echo.append(Echo(text, ids))
    shape = ResponseShape(
        "text",
        rid,
        model_name,
        body.num_logprobs(),
        body.n,
        echo if body.echo else None,
        body.prompt_only,
    )
    return reqs, shape


def _choice_requests(
    rid: str, first: int, total: int, choices: list[SamplingParams], **prompt: Any
) -> list[GenerateRequest]:
    """One backend request per choice of one prompt (``prompt``: its text or messages and
    ids), numbered from ``first`` of the response's ``total`` choices."""
    return [
        GenerateRequest(choice_id(rid, first + i, total), params, **prompt)
        for i, params in enumerate(choices)
    ]


async def _bad_words_token_ids(backend: Backend, body: GenerateBody) -> tuple[tuple[int, ...], ...]:
    """The body's bad_words as token id sequences (ApiError 400 naming bad_words), the words
    checked before they are tokenized."""
    if not body.bad_words:
        return ()
    words = valid(lambda: SamplingParams(bad_words=body.bad_words).bad_words)
    return await asyncio.to_thread(valid, lambda: backend.bad_words_token_ids(words))


class ChatTemplateOptions(Protocol):
    """What a body (chat, or /tokenize's messages) tells the chat template besides messages."""

    add_generation_prompt: bool
    continue_final_message: bool
    tools: list[Tool] | None


def chat_ids(
    backend: Backend, messages: list[dict[str, Any]], options: ChatTemplateOptions
) -> list[int]:
    """The messages' token ids through the chat template (ApiError 400 when it refuses)."""
    template = {
        "add_generation_prompt": options.add_generation_prompt,
        "continue_final_message": options.continue_final_message,
        "tools": template_tools(options.tools),
    }
    try:
        return valid(lambda: backend.tokenize_chat(messages, **template))
    except jinja2.TemplateError as e:  # templates that raise, e.g. on roles out of order
        raise ApiError(400, f"messages: {e}", param="messages") from None
