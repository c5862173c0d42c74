"""The HTTP API against hostile input: every number bounded, bodies bounded and parsed off the
event loop, errors that carry no internals, and the OpenAPI schema and its page.

Served by uvicorn on loopback over a LocalBackend on tiny-random (the ``server`` fixture of
conftest.py); the schema itself is fuzzed in test_api_schema.py."""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel

from kvmesh.cluster.frontend import WorkerLostError
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import DEFAULT_MAX_REQUEST_BYTES, build_api
from kvmesh.cluster.response_models import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ErrorResponse,
    ModelList,
)
from kvmesh.workers.kv_cache_manager import RequestTooLargeError
from kvmesh.workers.sampling_params import SamplingParams
from tests.openai_helpers import MAX_LEN, MODEL, USER, Spy, call, serve

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MIB = 1024 * 1024


def chat(**fields: Any) -> tuple[str, Any]:
    return CHAT, {"model": MODEL, "messages": USER, **fields}


def complete(**fields: Any) -> tuple[str, Any]:
    return COMPLETIONS, {"model": MODEL, "prompt": "a", **fields}


def raw_chat(fragment: str) -> tuple[str, bytes]:
    """A chat body with ``fragment`` spliced in as written: JSON's non-standard literals
    (NaN, Infinity) and numbers no float holds cannot be written with json.dumps."""
    return CHAT, f'{{"model": "{MODEL}", "messages": {json.dumps(USER)}, {fragment}}}'.encode()


def assert_bad(status: int, body: Any, param: str | None, code: int = 400) -> None:
    assert status == code, body
    ErrorResponse.model_validate(body)
    error = body["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    if param is not None:
        assert error["message"].startswith(f"{param}: "), error


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
    "a stop list holding a number": (chat(stop=["a", 3]), "stop"),
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
    from kvmesh.cluster.serve_app import parse_request

    for field, value in (("seed", 2**80), ("temperature", float("nan")), ("top_k", 10**12)):
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


# -- errors without internals -------------------------------------------------------------------


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


def sse_events(port: int, path: str, body: Any) -> tuple[int, list[Any]]:
    """Status, and the parsed ``data:`` events of a stream (a JSON body when not a stream)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    if not r.getheader("content-type", "").startswith("text/event-stream"):
        return r.status, [json.loads(text)]
    datas = [ln[len("data: ") :] for ln in text.split("\n") if ln.startswith("data: ")]
    assert datas[-1] == "[DONE]"
    return r.status, [json.loads(d) for d in datas[:-1]]


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


# -- OpenAPI ------------------------------------------------------------------------------------


def test_openapi_declares_the_models_and_docs_serve_it(server: tuple[int, Spy]) -> None:
    port = server[0]
    status, page = call(port, "GET", "/docs")
    assert status == 200 and "swagger" in page.lower() and "/openapi.json" in page
    status, schema = call(port, "GET", "/openapi.json")
    assert status == 200
    components = schema["components"]["schemas"]
    for path, request, response in (
        (CHAT, "ChatCompletionRequest", "ChatCompletionResponse"),
        (COMPLETIONS, "CompletionRequest", "CompletionResponse"),
    ):
        op = schema["paths"][path]["post"]
        assert op["requestBody"]["required"] is True
        body = op["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request}"}
        fields = set(components[request]["properties"])
        assert {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream"} <= fields
        responses = op["responses"]
        assert {"200", "400", "404", "413", "500"} <= set(responses) and "422" not in responses
        ok = responses["200"]["content"]
        assert ok["application/json"]["schema"] == {"$ref": f"#/components/schemas/{response}"}
        assert "text/event-stream" in ok
        assert set(components[response]["properties"]) >= {"usage", "kvmesh", "choices"}
    temperature = components["ChatCompletionRequest"]["properties"]["temperature"]["anyOf"][0]
    assert temperature == {"type": "number", "minimum": 0, "maximum": 2}
    models = schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]
    assert models["application/json"]["schema"] == {"$ref": "#/components/schemas/ModelList"}


def test_with_a_key_the_schema_says_so_and_stays_open(backend: LocalBackend) -> None:
    with serve(build_api(backend, model_name=MODEL, api_key="s3cret")) as port:
        assert call(port, "GET", "/docs")[0] == 200
        status, schema = call(port, "GET", "/openapi.json")
        assert status == 200
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert schema["paths"][CHAT]["post"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/health"]["get"]
        assert "401" in schema["paths"][CHAT]["post"]["responses"]


STREAMS: dict[str, tuple[str, dict[str, Any], type[BaseModel], type[BaseModel]]] = {
    "chat": (
        CHAT,
        chat(logprobs=True, top_logprobs=2)[1],
        ChatCompletionResponse,
        ChatCompletionChunk,
    ),
    "completions": (COMPLETIONS, complete(logprobs=2)[1], CompletionResponse, CompletionChunk),
}


@pytest.mark.parametrize("case", STREAMS)
def test_responses_and_stream_chunks_match_the_models(server: tuple[int, Spy], case: str) -> None:
    """What schemathesis checks on random requests, on the paths it rarely reaches: logprobs
    and usage, whole and streamed."""
    path, body, full, chunk = STREAMS[case]
    body = {**body, "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    status, got = call(server[0], "POST", path, body)
    assert status == 200, got
    assert full.model_validate(got).choices[0].logprobs is not None  # type: ignore[attr-defined]
    options = {"include_usage": True}
    status, events = sse_events(
        server[0], path, {**body, "stream": True, "stream_options": options}
    )
    assert status == 200 and len(events) >= 3
    for event in events:
        chunk.model_validate(event)
    assert events[-1]["usage"]["completion_tokens"] == 6 and events[-1]["kvmesh"]
    ModelList.model_validate(call(server[0], "GET", "/v1/models")[1])


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
