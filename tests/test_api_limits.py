"""The HTTP API's limits on hostile input: every number bounded (as in SamplingParams and the
Python handle), and bodies bounded (413) and parsed off the event loop, /health answering meanwhile.

Served by uvicorn on loopback over a LocalBackend on tiny-random (the ``server`` fixture of
conftest.py); the schema itself is fuzzed in test_api_schema.py."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import DEFAULT_MAX_REQUEST_BYTES, build_api
from kvmesh.cluster.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
)
from kvmesh.workers.sampling_params import SamplingParams
from tests.api_helpers import CHAT, COMPLETIONS, assert_bad, chat, complete
from tests.openai_helpers import MAX_LEN, MODEL, USER, Spy, call, serve

MIB = 1024 * 1024


def raw_chat(fragment: str) -> tuple[str, bytes]:
    """A chat body with ``fragment`` spliced in as written: JSON's non-standard literals
    (NaN, Infinity) and numbers no float holds cannot be written with json.dumps."""
    return CHAT, f'{{"model": "{MODEL}", "messages": {json.dumps(USER)}, {fragment}}}'.encode()


# -- bounds -----------------------------------------------------------------------------------

OUT_OF_BOUNDS: dict[str, tuple[tuple[str, Any], str | None]] = {
    "temperature NaN": (raw_chat('"temperature": NaN'), "temperature"),
    "temperature Infinity": (raw_chat('"temperature": Infinity'), "temperature"),
    "temperature -Infinity": (raw_chat('"temperature": -Infinity'), "temperature"),
    "temperature 1e400 (inf)": (raw_chat('"temperature": 1e400'), "temperature"),
    "temperature 1e308": (chat(temperature=1e308), "temperature"),
    "temperature 2.5": (chat(temperature=2.5), "temperature"),
    "top_p NaN": (raw_chat('"top_p": NaN'), "top_p"),
    "top_p 1e-400 (0)": (raw_chat('"top_p": 1e-400'), "top_p"),
    "top_k 10**12": (chat(top_k=10**12), "top_k"),
    "top_k 2**20 + 1": (chat(top_k=2**20 + 1), "top_k"),
    "top_k -2": (chat(top_k=-2), "top_k"),
    "top_k 1.5": (chat(top_k=1.5), "top_k"),
    "seed 2**80": (chat(seed=2**80), "seed"),
    "seed 2**63": (chat(seed=2**63), "seed"),
    "seed -2**63 - 1": (chat(seed=-(2**63) - 1), "seed"),
    "seed a string": (chat(seed="7"), "seed"),
    "2,000 stop strings": (chat(stop=["x"] * 2000), "stop"),
    "17 stop strings": (chat(stop=[f"s{i}" for i in range(17)]), "stop"),
    "a stop string of 257 chars": (chat(stop="y" * 257), "stop"),
    "a stop list holding a number": (chat(stop=["a", 3]), "stop[1]"),
    "max_tokens 10**9": (chat(max_tokens=10**9), "max_tokens"),
    "max_tokens 10**30": (complete(max_tokens=10**30), "max_tokens"),
    "max_tokens a string": (chat(max_tokens="10"), "max_tokens"),
    "max_tokens a float": (complete(max_tokens=1.5), "max_tokens"),
    "max_tokens a boolean": (complete(max_tokens=True), "max_tokens"),
    "max_completion_tokens 10**9": (chat(max_completion_tokens=10**9), "max_completion_tokens"),
    "top_logprobs 10**9": (chat(logprobs=True, top_logprobs=10**9), "top_logprobs"),
    "top_logprobs -1": (chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    "completion logprobs 21": (complete(logprobs=21), "logprobs"),
    "n 10**12": (chat(n=10**12), "n"),
    "messages past the context": (
        chat(messages=[{"role": "user", "content": "x" * (2 * MAX_LEN)}]),
        "messages",
    ),
    "prompt ids past the context": (complete(prompt=[1] * MAX_LEN), "prompt"),
    "prompt + max_tokens past the context": (
        complete(prompt=[1] * (MAX_LEN // 2), max_tokens=MAX_LEN // 2 + 1),
        "max_tokens",
    ),
    "a token id of 2**70": (complete(prompt=[2**70]), "prompt"),
    "ignore_eos a string": (chat(ignore_eos="yes"), "ignore_eos"),
}


@pytest.mark.parametrize("case", OUT_OF_BOUNDS)
def test_out_of_bounds_is_a_400_naming_the_field(server: tuple[int, Spy], case: str) -> None:
    (path, body), param = OUT_OF_BOUNDS[case]
    port, spy = server
    calls = spy.calls
    for stream in (False, True):
        if isinstance(body, dict):
            body = {**body, "stream": stream}
        status, got = call(port, "POST", path, body)
        assert_bad(status, got, param)
    assert spy.calls == calls  # refused before the backend saw it


HUGE = "g" * 100_000
ECHOES: dict[str, tuple[tuple[str, Any], str, int]] = {
    "a model name": (chat(model=HUGE), "model", 404),
    "a logit_bias key": (chat(logit_bias={HUGE: 1}), "logit_bias", 400),
    "a named tool_choice": (
        chat(
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": HUGE}},
        ),
        "tool_choice.function.name",
        400,
    ),
}


@pytest.mark.parametrize("case", ECHOES)
def test_a_huge_value_is_not_echoed_back_whole(server: tuple[int, Spy], case: str) -> None:
    (path, body), param, code = ECHOES[case]
    status, got = call(server[0], "POST", path, body)
    assert_bad(status, got, param, code)
    assert len(got["error"]["message"]) < 300, len(got["error"]["message"])


IN_BOUNDS: dict[str, tuple[str, Any]] = {
    "temperature 2": chat(temperature=2),
    "temperature 1e-300 (samples at 0.01)": chat(temperature=1e-300, seed=1),
    "top_p 5e-324 (the likeliest token)": chat(top_p=5e-324, seed=1),
    "top_k 2**20 (past the vocabulary: every token)": chat(top_k=2**20, seed=1),
    "top_k -1 (off, as in vLLM)": chat(top_k=-1, seed=1),
    "seed -2**63": chat(seed=-(2**63)),
    "seed 2**63 - 1": chat(seed=2**63 - 1),
    "16 stop strings of 256 chars": chat(stop=[f"{i:03}" + "z" * 253 for i in range(16)]),
    "top_logprobs 20": chat(logprobs=True, top_logprobs=20),
    "completion logprobs 20": complete(logprobs=20),
}


@pytest.mark.parametrize("case", IN_BOUNDS)
def test_the_bounds_themselves_are_accepted(server: tuple[int, Spy], case: str) -> None:
    path, body = IN_BOUNDS[case]
    status, got = call(server[0], "POST", path, {**body, "max_tokens": 3})
    assert status == 200, got
    model = ChatCompletionResponse if path == CHAT else CompletionResponse
    model.model_validate(got)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": 10**400}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_k": 10**12}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": 2**80}, "seed"),
        ({"seed": 10**5000}, "seed"),  # past str()'s digit limit: the message still works
        ({"stop": ["x"] * 2000}, "stop"),
        ({"stop": "y" * 257}, "stop"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_sampling_params_bounds(fields: dict[str, Any], param: str) -> None:
    """The Python API refuses what HTTP refuses, with the same field first."""
    with pytest.raises(ValueError, match=f"^{param}: ") as e:
        SamplingParams(**fields)
    assert len(str(e.value)) < 300  # a huge value is not echoed back whole


def test_tiny_temperature_and_top_p_are_floored() -> None:
    p = SamplingParams(temperature=1e-300, top_p=5e-324)
    assert p.temperature == SamplingParams.MIN_SAMPLING_TEMPERATURE and not p.greedy
    assert p.top_p == SamplingParams.MIN_TOP_P
    assert SamplingParams(temperature=0).greedy


def test_the_python_handle_refuses_the_same() -> None:
    from kvmesh.cluster.handle_generate import parse_request

    cases = [("seed", 2**80), ("temperature", float("nan")), ("top_k", 10**12)]
    cases += [("request_id", [1, 2]), ("request_id", "x" * 10**6), ("request_id", "")]
    for field, value in cases:
        with pytest.raises(ValueError, match=f"^{field}: "):
            parse_request({"prompt": "a", field: value})


# -- body size and the event loop ---------------------------------------------------------------


def test_the_body_limit_is_exact(backend: LocalBackend) -> None:
    """A body of exactly max_request_bytes is served; one byte more is a 413."""
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1}).encode()
    with serve(build_api(backend, model_name=MODEL, max_request_bytes=1000)) as port:
        padded = body[:-1] + b" " * (1000 - len(body)) + b"}"
        assert call(port, "POST", COMPLETIONS, padded)[0] == 200
        status, got = call(port, "POST", COMPLETIONS, padded + b" ")
        assert status == 413 and got["error"]["code"] == "request_too_large", got
        ErrorResponse.model_validate(got)


@pytest.mark.parametrize("coding", ["gzip", "br", "deflate, gzip", "x" * 300])
def test_a_compressed_body_is_a_415_naming_the_coding(server: tuple[int, Spy], coding: str) -> None:
    """Compressed JSON is refused as compressed (415, Accept-Encoding: identity), not as
    invalid JSON (400); a long header value is not echoed whole."""
    body = gzip.compress(json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1}).encode())
    conn = http.client.HTTPConnection("127.0.0.1", server[0], timeout=30)
    conn.request(
        "POST",
        COMPLETIONS,
        body,
        {"Content-Type": "application/json", "Content-Encoding": coding},
    )
    r = conn.getresponse()
    got = json.loads(r.read())
    conn.close()
    assert r.status == 415, got
    assert r.getheader("Accept-Encoding") == "identity"
    assert got["error"]["code"] == "unsupported_content_encoding", got
    assert coding[:32] in got["error"]["message"] and len(got["error"]["message"]) < 200
    ErrorResponse.model_validate(got)


@pytest.mark.parametrize("coding", ["identity", "Identity", ""])
def test_an_identity_coding_is_served(server: tuple[int, Spy], coding: str) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 1}
    status, got = call(server[0], "POST", COMPLETIONS, body, **{"Content-Encoding": coding})
    assert status == 200, got


def read_response(sock: socket.socket, timeout: float) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of the one response on ``sock`` (Content-Length framed)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    headers = dict(line.split(": ", 1) for line in head.decode().split("\r\n")[1:])
    length = int(headers.get("content-length", headers.get("Content-Length", "0")))
    while len(rest) < length:
        rest += sock.recv(65536)
    return int(head.split()[1]), json.loads(rest[:length])


def test_a_declared_oversize_body_is_refused_before_it_is_read(server: tuple[int, Spy]) -> None:
    with socket.create_connection(("127.0.0.1", server[0])) as sock:
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {50 * MIB}\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"model": ')  # and nothing more
        status, body = read_response(sock, timeout=5)
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert str(DEFAULT_MAX_REQUEST_BYTES) in body["error"]["message"]


def test_a_chunked_oversize_body_is_refused_once_past_the_limit(server: tuple[int, Spy]) -> None:
    """No Content-Length: the bytes are counted as they come, and the 413 is sent while the
    body has not ended (its last chunk is never sent)."""
    piece = b"x" * 65536
    chunk = f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
    with socket.create_connection(("127.0.0.1", server[0])) as sock:
        head = (
            f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n"
        )
        sock.sendall(head.encode())
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // len(piece) + 1):
            sock.sendall(chunk)
        status, body = read_response(sock, timeout=5)
    assert status == 413 and body["error"]["code"] == "request_too_large", body


@contextlib.contextmanager
def health_probe(port: int) -> Iterator[list[float]]:
    """Times GET /health, one after another, in a thread while the block runs."""
    latencies: list[float] = []
    statuses: list[int] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.perf_counter()
            statuses.append(call(port, "GET", "/health")[0])
            latencies.append(time.perf_counter() - start)
            done.wait(0.02)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        done.set()
        thread.join(timeout=10)
    assert set(statuses) == {200}


def test_a_50_mb_body_is_a_413_and_health_stays_responsive(server: tuple[int, Spy]) -> None:
    port, spy = server
    calls = spy.calls
    body = b'{"model": "tiny-random", "prompt": "' + b"x" * (50 * MIB) + b'"}'
    with health_probe(port) as latencies:
        status, got = call(port, "POST", COMPLETIONS, body)  # http.client sends it all
    assert status == 413 and got["error"]["code"] == "request_too_large", got
    assert latencies and max(latencies) < 0.5, max(latencies)
    assert spy.calls == calls


def max_size(kind: str) -> tuple[str, Any, str]:
    """(path, body, the field refused) for a body just under DEFAULT_MAX_REQUEST_BYTES whose
    prompt is far past the context: seconds of tokenizing, then a 400."""
    room = DEFAULT_MAX_REQUEST_BYTES - 1000
    text = "hello world " * (room // 12)
    if kind == "prompt text":
        return COMPLETIONS, {"model": MODEL, "prompt": text}, "prompt"
    if kind == "chat messages":
        messages = [{"role": "user", "content": text[: room // 2]}] * 2
        return CHAT, {"model": MODEL, "messages": messages}, "messages"
    return COMPLETIONS, {"model": MODEL, "prompt": [1] * (room // 3)}, "prompt"  # "1, "


@pytest.mark.parametrize("kind", ["prompt text", "chat messages", "token ids"])
def test_a_max_size_body_leaves_the_event_loop_free(server: tuple[int, Spy], kind: str) -> None:
    """Parsing, the chat template and tokenizing run in threads: /health answers while a
    max-size body is processed."""
    path, body, param = max_size(kind)
    raw = json.dumps(body).encode()
    assert DEFAULT_MAX_REQUEST_BYTES - 2000 < len(raw) <= DEFAULT_MAX_REQUEST_BYTES
    with health_probe(server[0]) as latencies:
        status, got = call(server[0], "POST", path, raw)
    assert_bad(status, got, param)
    assert latencies and max(latencies) < 0.5, max(latencies)
