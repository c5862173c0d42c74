"""Errors as the HTTP API answers them: OpenAI's error body, never internals.

Where the backend is called, a ValueError (also one a Ray task error wraps) is a 400 with the
ValueError's own message;
an overloaded server (our admission, or Ray Serve's ``BackPressureError`` from a worker
deployment's queue) is a 429 with ``Retry-After``; ``Unavailable`` is a 503 naming its cause;
anything else is a 500 whose detail goes to the log only, under a reference the message gives.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvmesh.cluster.api_error import ApiError, error_body, root_cause
from kvmesh.cluster.backend import Unavailable
from kvmesh.cluster.request_parsing import describe_errors

logger = logging.getLogger(__name__)
T = TypeVar("T")
OVERLOADED_STATUS = 429  # OpenAI's "engine is currently overloaded" status too
DEFAULT_RETRY_AFTER_S = 1.0


class Overloaded(ApiError):
    """The server admits no more requests now: 429, ``Retry-After`` (whole seconds, at least
    1), type ``overloaded_error``, code ``overloaded``. A client that retries after that long
    is likely to get in; nothing about the request itself was wrong."""

    def __init__(self, message: str, retry_after_s: float = DEFAULT_RETRY_AFTER_S) -> None:
        super().__init__(OVERLOADED_STATUS, message, "overloaded_error", code="overloaded")
        self.retry_after = max(1, math.ceil(retry_after_s))
        self.headers = {"Retry-After": str(self.retry_after)}


def as_api_error(e: Exception, where: str, *, bad_input: bool = True) -> ApiError:
    """The answer for ``e`` (see the module docstring); a 500 is logged under its reference.
    ``bad_input`` False: a ValueError is the server's own fault, a 500 too."""
    if isinstance(e, ApiError):
        return e
    root = root_cause(e)
    if bad_input and isinstance(root, ValueError):
        return ApiError.bad_input(root)
    if isinstance(root, BackPressureError):
        # A worker deployment's queue at this ingress is full (Serve's max_queued_requests).
        return Overloaded(
            "server overloaded: the workers' queue is full; retry later",
            root.retry_after_s if root.retry_after_s is not None else DEFAULT_RETRY_AFTER_S,
        )
    if isinstance(root, DeploymentUnavailableError):
        return ApiError(503, "no worker is available now", "server_error", code="unavailable")
    if isinstance(root, Unavailable):
        return ApiError(503, str(root), "server_error", code="unavailable")
    ref = uuid.uuid4().hex[:12]
    logger.error("%s failed (ref %s)", where, ref, exc_info=e)
    return ApiError(500, f"internal server error (ref {ref})", "server_error")


async def call_backend(aw: Awaitable[T]) -> T:
    """Await the backend; what it raises becomes the ``ApiError`` to answer with."""
    try:
        return await aw
    except StopAsyncIteration:
        raise ApiError(500, "the backend's stream ended without output", "server_error") from None
    except Exception as e:
        raise as_api_error(e, "backend call") from None


def error_response(error: ApiError) -> JSONResponse:
    headers = error.headers if isinstance(error, Overloaded) else None
    return JSONResponse(error.body, status_code=error.status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """OpenAI's error body for every error FastAPI or a route raises; FastAPI's 422 is a 400."""

    async def api_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, ApiError)
        return error_response(e)

    async def http_error(request: Request, e: Exception) -> Response:
        assert isinstance(e, StarletteHTTPException)
        type_ = "server_error" if e.status_code >= 500 else "invalid_request_error"
        return JSONResponse(
            error_body(str(e.detail), type_), status_code=e.status_code, headers=e.headers
        )

    async def validation_error(request: Request, e: Exception) -> Response:
        # FastAPI answers 422 with its own body; OpenAI and vLLM answer 400 with theirs.
        assert isinstance(e, RequestValidationError)
        message, param = describe_errors(e.errors())
        return JSONResponse(error_body(message, param=param), status_code=400)

    async def unexpected(request: Request, e: Exception) -> Response:
        # The routes raise ApiError for what they refuse, and the backend's ValueErrors are
        # converted where it is called (``call_backend``): one that reaches here is the
        # server's own fault, never the client's (writing a non-finite float into a response
        # once answered 400, with json.dumps' message).
        assert isinstance(e, Exception)
        where = f"{request.method} {request.url.path}"
        return error_response(as_api_error(e, where, bad_input=False))

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
