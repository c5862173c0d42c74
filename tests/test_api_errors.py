"""The HTTP API's errors carry no internals: backend errors (bare or wrapped by Ray) at admission
and inside a started stream, unexpected errors in the API, FastAPI's validation as OpenAI 400s,
and a request whose worker was lost too often as a 503 naming the cause."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from kvmesh.cluster.backend import Chunk, Completion
from kvmesh.cluster.frontend import WorkerLostError
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from kvmesh.cluster.response_models import ChatCompletionChunk, ErrorResponse
from kvmesh.workers.kv_allocation import RequestTooLargeError
from tests.api_helpers import CHAT, assert_bad, chat, complete, sse_events
from tests.openai_helpers import MODEL, Spy, call, serve


def ray_wrapped(cause: BaseException) -> BaseException:
    """``cause`` as a Ray actor call raises it: a RayTaskError(<cause's type>) whose own text
    is the remote traceback, with the pid, node address and actor id."""
    from ray.exceptions import RayTaskError

    tb = (
        'Traceback (most recent call last):\n  File "/opt/kvmesh/workers/worker.py", line 9\n'
        f"{type(cause).__name__}: {cause}"
    )
    return RayTaskError(
        "Worker.generate_stream",
        tb,
        cause,
        proctitle="ray::Worker.generate_stream",
        pid=4242,
        ip="10.1.2.3",
        actor_repr="Worker(decode-0)",
        actor_id="f00dfeed00",
    ).as_instanceof_cause()


INTERNALS = ("Traceback", "pid", "4242", "10.1.2.3", "actor", "f00dfeed", "ray::", "worker.py")
SEED_ERROR = "seed: must be a 64-bit signed integer, in [-2**63, 2**63 - 1], got 5"
KV_ERROR = "request needs 900 tokens of KV cache but the pool holds at most 512"
# case: (the exception the backend raises, status, the message or None, param)
WRAPPED: dict[str, tuple[Callable[[], BaseException], int, str | None, str | None]] = {
    "a seed ValueError": (lambda: ray_wrapped(ValueError(SEED_ERROR)), 400, SEED_ERROR, "seed"),
    "the KV pool's error": (
        lambda: ray_wrapped(RequestTooLargeError(KV_ERROR)),
        400,
        KV_ERROR,
        None,
    ),
    "a task in a task": (
        lambda: ray_wrapped(ray_wrapped(ValueError("prompt: too long"))),
        400,
        "prompt: too long",
        "prompt",
    ),
    "a plain ValueError": (lambda: ValueError("top_p: no"), 400, "top_p: no", "top_p"),
    "an engine failure": (
        lambda: ray_wrapped(RuntimeError("CUDA error: illegal address at 10.1.2.3")),
        500,
        None,
        None,
    ),
    "a dead actor": (lambda: ray_wrapped(ConnectionError("actor f00dfeed died")), 500, None, None),
}


def check_error(
    error: dict[str, Any], status: int, message: str | None, param: str | None, caplog: Any
) -> None:
    assert not any(s in error["message"] for s in INTERNALS), error
    if status == 400:
        assert error == {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": None,
        }
    else:
        assert error["type"] == "server_error" and error["param"] is None, error
        assert error["message"].startswith("internal server error (ref "), error
        ref = error["message"].split("ref ")[1].rstrip(")")
        logged = [r for r in caplog.records if ref in r.getMessage()]
        assert logged and logged[0].exc_info is not None  # the detail is in the log


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", WRAPPED)
def test_backend_errors_carry_no_internals(
    backend: LocalBackend, caplog: pytest.LogCaptureFixture, case: str, stream: bool
) -> None:
    """What the backend raises at admission: a ValueError, bare or wrapped by Ray, is a 400
    with the ValueError's own message; anything else a 500 that says nothing."""
    fail, status, message, param = WRAPPED[case]
    caplog.set_level(logging.ERROR)
    with serve(build_api(Spy(backend, fail=fail), model_name=MODEL)) as port:
        got_status, got = call(port, "POST", *chat(max_tokens=2, stream=stream))
    assert got_status == status, got
    ErrorResponse.model_validate(got)
    check_error(got["error"], status, message, param, caplog)


@pytest.mark.parametrize("case", WRAPPED)
def test_errors_in_a_started_stream_carry_no_internals(
    backend: LocalBackend, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    fail, status, message, param = WRAPPED[case]
    caplog.set_level(logging.ERROR)
    spy = Spy(backend, fail=fail, fail_after=1)
    body = {**chat(max_tokens=8, stream=True)[1], "ignore_eos": True}  # never done early
    with serve(build_api(spy, model_name=MODEL)) as port:
        got_status, events = sse_events(port, CHAT, body)
    assert got_status == 200
    *chunks, last = events
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    ErrorResponse.model_validate(last)
    check_error(last["error"], status, message, param, caplog)


class ExplodingTokenizer(Spy):
    def tokenize(self, prompt: Any) -> list[int]:
        raise RuntimeError("tokenizer state at 0xdeadbeef is corrupt")


def test_an_unexpected_error_in_the_api_is_a_plain_500(
    backend: LocalBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR)
    with serve(build_api(ExplodingTokenizer(backend), model_name=MODEL)) as port:
        status, got = call(port, "POST", *complete())
    assert status == 500, got
    assert "deadbeef" not in got["error"]["message"]
    check_error(got["error"], 500, None, None, caplog)


def _nan(entries: list[dict[int, float]] | None) -> list[dict[int, float]]:
    return [{t: math.nan for t in entry} for entry in entries or []]


class NanLogprobs(Spy):
    """A worker whose logprobs are NaN (a fault injected on purpose): the response cannot be
    written as JSON."""

    async def generate(self, request: Any) -> Completion:
        c = await super().generate(request)
        return dataclasses.replace(c, logprobs=_nan(c.logprobs))

    async def stream(self, request: Any) -> AsyncIterator[Chunk]:
        async for chunk in super().stream(request):
            yield dataclasses.replace(chunk, logprobs=_nan(chunk.logprobs))


@pytest.mark.parametrize("stream", [False, True])
def test_a_value_error_of_the_api_itself_is_a_500(
    backend: LocalBackend, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """A ValueError the API raises itself (here json.dumps' on NaN) is the server's fault:
    a 500 with a reference (an error event in a stream), not a 400 blaming the request with
    json's message, and never NaN written into a stream."""
    caplog.set_level(logging.ERROR)
    with serve(build_api(NanLogprobs(backend), model_name=MODEL)) as port:
        status, events = sse_events(port, CHAT, chat(max_tokens=2, logprobs=True, stream=stream)[1])
    assert status == (200 if stream else 500), events
    check_error(events[-1]["error"], 500, None, None, caplog)


def test_fastapi_validation_errors_are_openai_400s(backend: LocalBackend) -> None:
    """FastAPI's own validation (a typed parameter) answers as OpenAI and vLLM do: a 400 with
    OpenAI's error body naming the field, not FastAPI's 422."""
    app = build_api(backend, model_name=MODEL)

    @app.get("/probe")
    async def probe(limit: int) -> dict[str, int]:
        return {"limit": limit}

    with serve(app) as port:
        assert call(port, "GET", "/probe?limit=3") == (200, {"limit": 3})
        status, got = call(port, "GET", "/probe?limit=many")
        assert_bad(status, got, "limit")
        status, got = call(port, "GET", "/no/such/route")
        assert status == 404 and set(got["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_whose_worker_was_lost_too_often_is_a_503_naming_the_cause(
    backend: LocalBackend, stream: bool
) -> None:
    def lost() -> WorkerLostError:
        return WorkerLostError("request r1: its worker was lost 4 times (max_migrations 3)")

    with serve(build_api(Spy(backend, fail=lost), model_name=MODEL)) as port:
        status, got = call(port, "POST", *chat(max_tokens=2, stream=stream))
    assert status == 503, got
    ErrorResponse.model_validate(got)
    assert got["error"]["type"] == "server_error"
    assert "lost 4 times (max_migrations 3)" in got["error"]["message"]
    spy = Spy(backend, fail=lost, fail_after=1)  # lost mid-stream, past max_migrations
    with serve(build_api(spy, model_name=MODEL)) as port:
        body = {**chat(max_tokens=8, stream=True)[1], "ignore_eos": True}  # never done early
        status, events = sse_events(port, CHAT, body)
    assert status == 200
    assert "max_migrations 3" in events[-1]["error"]["message"], events


def test_api_errors_pickle_whole() -> None:
    """Ray pickles what a handle call raises: status, body and Retry-After survive."""
    import pickle

    from kvmesh.cluster.api_error import ApiError
    from kvmesh.cluster.http_errors import Overloaded

    for e in (ApiError(400, "n: must be >= 1", param="n"), Overloaded("overloaded", 2.5)):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e)
        assert (back.status, back.body) == (e.status, e.body)
    assert pickle.loads(pickle.dumps(Overloaded("x", 2.5))).headers == {"Retry-After": "3"}
