"""Clients that leave, over a real engine (LocalBackend, tiny-random): a client that hangs
up aborts its request's choices on the engine, and a Serve proxy lost under a request is the
same thing; neither is an error of the server's."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import time
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from tests.api_helpers import COMPLETIONS, complete
from tests.openai_helpers import MAX_LEN, MODEL, Spy, wait_until

# Choices: each is a request of its own in the engine; a client that leaves aborts them all.
CHOICE_TOKENS = {1: MAX_LEN - 2, 3: 150}  # n -> max_tokens: all fit the pool at once


def slow_engine_aborts(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Slow ``engine``'s steps, so that a full answer takes seconds and a disconnect comes
    first; returns the list its aborts append their request ids to."""
    aborted: list[str] = []
    abort, step = engine.abort, engine.step

    def slow_step() -> Any:
        time.sleep(0.01)
        return step()

    def spy_abort(rid: str, reason: str | None = None) -> None:
        aborted.append(rid)
        abort(rid, reason)

    monkeypatch.setattr(engine, "abort", spy_abort)
    monkeypatch.setattr(engine, "step", slow_step)
    return aborted


@pytest.mark.parametrize("n", CHOICE_TOKENS)
@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts(
    server: tuple[int, Spy],
    backend: LocalBackend,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stream: bool,
    n: int,
) -> None:
    """A client that leaves aborts its request's choices, and is no error of the server's
    (before, one that left before its answer started was logged as a failed request with a
    traceback: the cancelled backend call read before its cancellation landed)."""
    caplog.set_level(logging.ERROR)
    engine = backend.worker.engine
    aborted = slow_engine_aborts(engine, monkeypatch)
    _, body = complete(max_tokens=CHOICE_TOKENS[n], ignore_eos=True, stream=stream, n=n)
    conn = http.client.HTTPConnection("127.0.0.1", server[0], timeout=30)
    conn.request("POST", COMPLETIONS, json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    else:
        wait_until(lambda: backend.worker.occupancy()["running"] == n, "the choices to run")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: len(aborted) == n, "the aborts", timeout=5)
    wait_until(lambda: not backend.worker.call(engine.request_ids), "the engine to drain")
    time.sleep(0.2)  # the route's own end, after the aborts
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_a_lost_serve_proxy_is_a_client_that_left(
    backend: LocalBackend, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Serve's proxy holding the client's connection dies mid-stream: the ingress's
    ``receive`` raises its ``ActorDiedError``. That is the client's leaving: the stream is
    aborted on the engine as a disconnect's, without an error logged (before: "POST
    /v1/completions failed (ref ...)" with a traceback, for a 500 to nobody)."""
    engine = backend.worker.engine
    aborted = slow_engine_aborts(engine, monkeypatch)
    app = build_api(backend, model_name=MODEL)
    _, body = complete(max_tokens=MAX_LEN - 2, ignore_eos=True, stream=True)
    scope = {
        "type": "http", "method": "POST", "path": COMPLETIONS, "raw_path": COMPLETIONS.encode(),
        "query_string": b"", "root_path": "", "scheme": "http", "http_version": "1.1",
        "headers": [(b"content-type", b"application/json")],
        "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
    }  # fmt: skip
    sent: list[dict] = []

    async def run() -> None:
        proxy_died = asyncio.Event()
        pieces = [{"type": "http.request", "body": json.dumps(body).encode()}]

        async def receive() -> dict:
            if pieces:
                return pieces.pop(0)
            await proxy_died.wait()
            raise ActorDiedError()

        async def send(message: dict) -> None:
            sent.append(message)
            if message.get("body", b"").startswith(b"data: "):
                proxy_died.set()  # after the first event, as a stream under way

        await asyncio.wait_for(app(scope, receive, send), 30)

    with caplog.at_level(logging.ERROR):
        asyncio.run(run())
    assert sent[0]["status"] == 200
    wait_until(lambda: len(aborted) == 1, "the abort", timeout=5)
    wait_until(lambda: not backend.worker.call(engine.request_ids), "the engine to drain")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
