"""vLLM's ``POST /tokenize`` and ``POST /detokenize``: a prompt's token ids as the generation
routes would compute them (so a client counts a prompt against ``max_model_len`` before it
sends it), and token ids back to text.

``/tokenize`` takes a completion prompt (``prompt``: text) or a chat (``messages``, with
chat's ``add_generation_prompt``, ``continue_final_message`` and ``tools``), exactly one,
and answers ``{"count", "max_model_len", "tokens", "token_strs"}``: ``token_strs`` (with
``return_token_strs: true``) are each token's own text, as logprobs' ``token`` shows it.
``add_special_tokens`` is accepted at what the generation routes do (a prompt: true; a chat:
false, its template has them) and refused otherwise: the count must be the one generating
would see. ``/detokenize`` takes ``tokens`` (ids of the vocabulary) and answers
``{"prompt"}``, special tokens kept. Both check ``model`` as the generation routes do, run
the tokenizer in a thread, and need the API key when one is set (vLLM leaves them open).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI

from kvmesh.cluster.api_error import ApiError, valid
from kvmesh.cluster.backend import Backend
from kvmesh.cluster.generate_body import check_model
from kvmesh.cluster.openai_requests import chat_ids
from kvmesh.cluster.openapi_doc import json_response, request_body
from kvmesh.cluster.protocol import DetokenizeRequest, TokenizeRequest
from kvmesh.cluster.request_parsing import json_body


def add_tokenize_routes(
    app: FastAPI,
    backend: Backend,
    model_name: str,
    dependencies: list[Any],
    errors: dict[int | str, Any],
) -> None:
    """``/tokenize`` and ``/detokenize`` on ``app``, behind ``dependencies`` (the API key)."""
    router = APIRouter(dependencies=dependencies)

    @router.post(
        "/tokenize",
        response_model=None,
        openapi_extra=request_body(TokenizeRequest),
        responses=json_response("TokenizeResponse", "The prompt's token ids.") | errors,
    )
    async def tokenize(
        body: Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest))],
    ) -> dict[str, Any]:
        """A prompt's (or a chat's) token ids, as the generation routes compute them."""
        check_model(body.model, model_name)
        ids = await asyncio.to_thread(_tokenize, backend, body)
        strs = await asyncio.to_thread(backend.token_texts, ids) if body.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": backend.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @router.post(
        "/detokenize",
        response_model=None,
        openapi_extra=request_body(DetokenizeRequest),
        responses=json_response("DetokenizeResponse", "The tokens' text.") | errors,
    )
    async def detokenize(
        body: Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest))],
    ) -> dict[str, Any]:
        """Token ids' text, special tokens kept."""
        check_model(body.model, model_name)
        vocab = backend.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise ApiError(400, f"tokens: must be token ids in [0, {vocab})", param="tokens")
        text = await asyncio.to_thread(backend.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}

    app.include_router(router)


def _tokenize(backend: Backend, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "prompt: give exactly one of prompt or messages", param="prompt")
    chat = body.messages is not None
    if body.add_special_tokens not in (None, not chat):
        raise ApiError(
            400,
            f"add_special_tokens: kvmesh tokenizes {'a chat' if chat else 'a prompt'} as "
            f"generating does: send {str(not chat).lower()} or leave it out",
            param="add_special_tokens",
        )
    if body.messages is None:
        assert body.prompt is not None
        return valid(lambda: backend.tokenize(body.prompt))
    return chat_ids(backend, [m.as_dict() for m in body.messages], body)
