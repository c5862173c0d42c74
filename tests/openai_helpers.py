"""Shared pieces for the OpenAI API tests: a LocalBackend on tiny-random served by uvicorn
on loopback, the official client for it, and a raw-HTTP caller."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import uvicorn

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest

MODEL = "tiny-random"
MAX_LEN = 256  # context; the pool (128 blocks of 4) holds two full-length requests
USER = [{"role": "user", "content": "Say something."}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@contextlib.contextmanager
def serve(app: Any) -> Iterator[int]:
    """Run ``app`` with uvicorn on a free loopback port in a thread; yields the port."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    wait_until(lambda: server.started, "uvicorn start")
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Spy:
    """The backend, counting generate/stream calls (bad input must never reach them) and
    keeping the last request (``last``).

    With ``fail``, each call raises ``fail()`` instead: ``generate`` at once, a stream after
    ``fail_after`` of the inner backend's chunks (0: from its first ``__anext__``, as an
    admission error does)."""

    def __init__(
        self,
        inner: Any,
        fail: Callable[[], BaseException] | None = None,
        fail_after: int = 0,
    ) -> None:
        self.inner, self.calls = inner, 0
        self.last: GenerateRequest | None = None
        self.fail, self.fail_after = fail, fail_after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request: GenerateRequest) -> Completion:
        self.calls += 1
        self.last = request
        if self.fail is not None:
            raise self.fail()
        return await self.inner.generate(request)

    def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        self.calls += 1
        self.last = request
        if self.fail is None:
            return self.inner.stream(request)
        return self._failing_stream(request, self.fail)

    async def _failing_stream(
        self, request: GenerateRequest, fail: Callable[[], BaseException]
    ) -> AsyncIterator[Chunk]:
        chunks = self.inner.stream(request)
        try:
            for _ in range(self.fail_after):
                yield await chunks.__anext__()
            raise fail()
        finally:
            await chunks.aclose()


def call(port: int, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    """One raw request; (status, JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **headers})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    with contextlib.suppress(ValueError):
        return r.status, strict_json(text)
    return r.status, text


def strict_json(text: str) -> Any:
    """``json.loads`` that fails on NaN and +-Infinity: Python writes and reads them, JSON
    has none, and a strict client (JavaScript's JSON.parse, Go's) cannot parse the body."""

    def refuse(name: str) -> Any:
        raise AssertionError(f"not JSON: {name} in {text[:300]!r}")

    return json.loads(text, parse_constant=refuse)


def check_kvmesh(kv: dict[str, Any], usage: Any) -> None:
    """The ``kvmesh`` object accounts for every prompt token, and agrees with ``usage``."""
    assert kv["worker"] == "local-0" and kv["ttft_ms"] >= 0
    hit = kv["local_hit_tokens"] + kv["host_hit_tokens"] + kv["disk_hit_tokens"]
    pulled = kv["pulled_tokens"]
    assert hit + pulled + kv["computed_tokens"] == usage.prompt_tokens
    assert hit + pulled == usage.prompt_tokens_details.cached_tokens
