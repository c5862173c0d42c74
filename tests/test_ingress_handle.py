"""IngressHandle without Ray: Serve's handle as the wrapper sees it, with the loss of the
ingress replica injected (its call raises Ray's ActorDiedError, as Serve's handle does). A
request lost before its answer is sent again whole, within the front door's bounds; a stream
lost after its first chunk ends with the front door's 503; any other error passes as it is.
tests/test_ingress_failover.py does it with real Serve and a killed replica."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayTaskError

from kvmesh.cluster.api_error import ApiError, BadRequest
from kvmesh.cluster.front_door import LOST, RETRIES, RETRY_PAUSE_S
from kvmesh.cluster.ingress_handle import IngressHandle

CHUNKS = [{"text": "a"}, {"text": "b"}, {"text": "c"}]


class LosingHandle:
    """A handle whose first ``losses`` sends are lost: an answer raises ``error``; a stream
    raises it after ``after`` chunks. Later sends answer ``method:args`` or ``CHUNKS``."""

    def __init__(
        self, losses: int, after: int = 0, error: Exception | None = None, stream: bool = False
    ) -> None:
        self.losses, self.after, self.stream = losses, after, stream
        self.error = error or ActorDiedError()
        self.sends: list[tuple[str, tuple]] = []
        self.timeouts: list[float | None] = []

    def options(self, stream: bool = False) -> LosingHandle:
        self.stream = stream
        return self

    def __getattr__(self, method: str) -> Any:
        if method.startswith("_"):
            raise AttributeError(method)
        handle = self

        class Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                handle.sends.append((method, args))
                lost = len(handle.sends) <= handle.losses
                if handle.stream:
                    return Chunks(handle.after if lost else None, handle.error)
                return Response(handle, f"{method}:{args[0]}", handle.error if lost else None)

        return Method()


class Response:
    def __init__(self, handle: LosingHandle, value: str, error: Exception | None) -> None:
        self.handle, self.value, self.error = handle, value, error

    def result(self, timeout_s: float | None = None) -> str:
        self.handle.timeouts.append(timeout_s)
        if self.error is not None:
            raise self.error
        return self.value

    def __await__(self) -> Any:
        async def answer() -> str:
            return self.result()

        return answer().__await__()


class Chunks:
    """A stream of CHUNKS that, lost, raises ``error`` after ``lost_after`` of them."""

    def __init__(self, lost_after: int | None, error: Exception) -> None:
        self.lost_after, self.error, self.sent = lost_after, error, 0

    def __next__(self) -> dict:
        if self.sent == self.lost_after:
            raise self.error
        if self.sent == len(CHUNKS):
            raise StopIteration
        self.sent += 1
        return CHUNKS[self.sent - 1]

    async def __anext__(self) -> dict:
        try:
            return next(self)
        except StopIteration:
            raise StopAsyncIteration from None


async def _awaited(answer: Any) -> Any:
    return await answer


def _lost_503(e: pytest.ExceptionInfo[ApiError]) -> None:
    assert e.value.status == 503
    assert (e.value.body["error"]["message"], e.value.body["error"]["code"]) == (
        LOST,
        "unavailable",
    )


def test_an_answer_lost_before_it_came_is_sent_again_whole() -> None:
    for error in (ActorDiedError(), ActorUnavailableError("unreachable", None)):
        serve = LosingHandle(losses=RETRIES, error=error)
        handle = IngressHandle(serve)
        assert handle.generate.remote({"prompt": "x"}).result() == "generate:{'prompt': 'x'}"
        assert serve.sends == [("generate", ({"prompt": "x"},))] * (RETRIES + 1)

        serve = LosingHandle(losses=RETRIES, error=error)
        answer = asyncio.run(_awaited(IngressHandle(serve).chat.remote({"messages": []})))
        assert answer == "chat:{'messages': []}"
        assert len(serve.sends) == RETRIES + 1


def test_an_answer_lost_on_every_try_raises_the_front_doors_503() -> None:
    serve = LosingHandle(losses=RETRIES + 1)
    started = time.monotonic()
    with pytest.raises(ApiError) as e:
        IngressHandle(serve).completions.remote({"prompt": "x"}).result()
    _lost_503(e)
    assert isinstance(e.value.__cause__, ActorDiedError)
    assert len(serve.sends) == RETRIES + 1
    assert time.monotonic() - started >= RETRIES * RETRY_PAUSE_S

    serve = LosingHandle(losses=RETRIES + 1)
    with pytest.raises(ApiError) as e:
        asyncio.run(_awaited(IngressHandle(serve).completions.remote({"prompt": "x"})))
    _lost_503(e)
    assert len(serve.sends) == RETRIES + 1


def test_serves_own_attributes_pass_and_any_other_name_is_a_method() -> None:
    class Named(LosingHandle):
        deployment_name = "KvmeshServer"

    handle = IngressHandle(Named(losses=0))
    assert handle.deployment_name == "KvmeshServer"
    assert handle.generate.remote({"p": 1}).result() == "generate:{'p': 1}"


def test_the_timeout_bounds_all_the_tries_together() -> None:
    serve = LosingHandle(losses=1)
    IngressHandle(serve).generate.remote({}).result(timeout_s=5.0)
    first, second = serve.timeouts
    assert first is not None and second is not None
    assert second <= first - RETRY_PAUSE_S


def test_other_errors_pass_as_they_are_and_are_not_sent_again() -> None:
    for error in (ApiError(400, "bad"), ValueError("max_tokens: must be >= 1")):
        serve = LosingHandle(losses=1, error=error)
        with pytest.raises(type(error)) as e:
            IngressHandle(serve).generate.remote({}).result()
        assert e.value is error and len(serve.sends) == 1


def _raised_by_the_ingress(cause: Exception) -> RayTaskError:
    """What Serve's handle raises for an error the ingress raised: Ray's wrapper, whose
    message holds the replica's traceback and ids."""
    tb = "Traceback (most recent call last):\n  ray::ServeReplica (pid=4242, actor_id=ab12)"
    return RayTaskError("generate", tb, cause).as_instanceof_cause()


def test_what_the_ingress_raised_is_raised_as_it_raised_it() -> None:
    """Its own message, not Ray's traceback, pid and actor id; never sent again (not even
    an ActorDiedError of a call the ingress made: that is not the ingress lost)."""
    for cause in (BadRequest(400, "max_tokens: must be at least 1"), ActorDiedError()):
        serve = LosingHandle(losses=1, error=_raised_by_the_ingress(cause))
        with pytest.raises(type(cause)) as e:
            IngressHandle(serve).generate.remote({}).result()
        assert e.value is cause and "pid=" not in str(e.value) and len(serve.sends) == 1
        assert isinstance(e.value.__cause__, RayTaskError)  # the remote traceback, for bugs

    serve = LosingHandle(losses=1, after=1, error=_raised_by_the_ingress(ValueError("v: bad")))
    stream = IngressHandle(serve).options(stream=True).generate.remote({})
    assert next(stream) == CHUNKS[0]
    with pytest.raises(ValueError, match=r"^v: bad$"):
        next(stream)
    assert len(serve.sends) == 1


def test_a_stream_lost_before_its_first_chunk_is_sent_again() -> None:
    serve = LosingHandle(losses=RETRIES)
    assert list(IngressHandle(serve).options(stream=True).chat.remote({})) == CHUNKS
    assert len(serve.sends) == RETRIES + 1

    serve = LosingHandle(losses=RETRIES)

    async def chunks() -> list[dict]:
        return [c async for c in IngressHandle(serve).options(stream=True).chat.remote({})]

    assert asyncio.run(chunks()) == CHUNKS
    assert len(serve.sends) == RETRIES + 1


def test_a_stream_lost_after_its_first_chunk_ends_with_the_503() -> None:
    """Sending it again would repeat what the caller has: it ends, as the HTTP stream ends
    with the front door's error event."""
    serve = LosingHandle(losses=1, after=2)
    got: list[dict] = []
    with pytest.raises(ApiError) as e:
        for chunk in IngressHandle(serve).options(stream=True).generate.remote({}):
            got.append(chunk)
    _lost_503(e)
    assert got == CHUNKS[:2] and len(serve.sends) == 1

    serve = LosingHandle(losses=1, after=1)
    got = []

    async def read() -> None:
        async for chunk in IngressHandle(serve).options(stream=True).generate.remote({}):
            got.append(chunk)

    with pytest.raises(ApiError) as e:
        asyncio.run(read())
    _lost_503(e)
    assert got == CHUNKS[:1] and len(serve.sends) == 1


def test_a_stream_lost_on_every_try_raises_the_503() -> None:
    serve = LosingHandle(losses=RETRIES + 1)
    with pytest.raises(ApiError) as e:
        list(IngressHandle(serve).options(stream=True).generate.remote({}))
    _lost_503(e)
    assert len(serve.sends) == RETRIES + 1
