"""The OpenAI API over a real engine (LocalBackend, tiny-random), served by uvicorn on
loopback and driven by the official ``openai`` client; bad input through raw HTTP."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import openai
import pytest
import uvicorn

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from kvmesh.workers.sampling_params import SamplingParams

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
    """The backend, counting generate/stream calls (bad input must never reach them)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request: GenerateRequest) -> Completion:
        self.calls += 1
        return await self.inner.generate(request)

    def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        self.calls += 1
        return self.inner.stream(request)


@pytest.fixture(scope="module")
def backend() -> Iterator[LocalBackend]:
    b = LocalBackend(
        model=MODEL, block_size=4, num_kv_blocks=128, max_model_len=MAX_LEN, progress=False
    )
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def server(backend: LocalBackend) -> Iterator[tuple[int, Spy]]:
    spy = Spy(backend)
    with serve(build_api(spy, model_name=MODEL)) as port:
        yield port, spy


@pytest.fixture
def client(server: tuple[int, Spy]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server[0]}/v1", api_key="test", max_retries=0)


def call(port: int, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, Any]:
    """One raw request; (status, JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, data, {"Content-Type": "application/json", **headers})
    r = conn.getresponse()
    text = r.read().decode()
    conn.close()
    with contextlib.suppress(ValueError):
        return r.status, json.loads(text)
    return r.status, text


def check_kvmesh(kv: dict[str, Any], usage: Any) -> None:
    """The ``kvmesh`` object accounts for every prompt token, and agrees with ``usage``."""
    assert kv["worker"] == "local-0" and kv["ttft_ms"] >= 0
    hit, pulled = kv["local_hit_tokens"], kv["pulled_tokens"]
    assert hit + pulled + kv["computed_tokens"] == usage.prompt_tokens
    assert hit + pulled == usage.prompt_tokens_details.cached_tokens


# -- the happy paths --------------------------------------------------------------------------


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY)
    assert full.object == "chat.completion" and full.model == MODEL
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    check_kvmesh(full.kvmesh, full.usage)

    options = {"include_usage": True}
    stream = client.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options=options, **GREEDY
    )
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    last, usage = chunks[-2], chunks[-1]
    assert last.choices[0].finish_reason == "length" and "kvmesh" in last.model_extra
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    check_kvmesh(usage.kvmesh, usage.usage)
    assert usage.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, again


def test_completions_stream_matches_non_stream(
    client: openai.OpenAI, backend: LocalBackend
) -> None:
    full = client.completions.create(model=MODEL, prompt="Once upon a time", **GREEDY)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == len(backend.tokenize("Once upon a time"))
    stream = client.completions.create(
        model=MODEL, prompt="Once upon a time", stream=True, **GREEDY
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].usage is None
    check_kvmesh(full.kvmesh, full.usage)
    assert chunks[-1].kvmesh["worker"] == "local-0"
    # Token ids, and a batch of one, are the same prompt.
    ids = backend.tokenize("Once upon a time")
    for prompt in (ids, [ids], ["Once upon a time"]):
        again = client.completions.create(model=MODEL, prompt=prompt, **GREEDY)
        assert again.choices[0].text == full.choices[0].text


def test_models_and_health(client: openai.OpenAI, server: tuple[int, Spy]) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]
    assert call(server[0], "GET", "/health") == (200, {"status": "ok"})


def test_repeated_long_prompt_is_cached(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 3}]
    first = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    second = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    n = second.usage.prompt_tokens
    assert n > 100 and first.usage.prompt_tokens == n
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= n - 4 - 1  # all but the last (partial) block, one token left to compute
    assert second.kvmesh["local_hit_tokens"] == cached
    check_kvmesh(second.kvmesh, second.usage)
    assert second.choices[0].message.content == first.choices[0].message.content


# -- bad input --------------------------------------------------------------------------------

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OK = {"model": MODEL, "messages": USER}


def chat(**fields: Any) -> tuple[str, Any]:
    return CHAT, {**OK, **fields}


def complete(**fields: Any) -> tuple[str, Any]:
    return COMPLETIONS, {"model": MODEL, "prompt": "a", **fields}


LONG = "x" * MAX_LEN
BAD_INPUT: dict[str, tuple[Any, ...]] = {  # case: ((path, body), param[, status])
    "invalid JSON": ((CHAT, b'{"model": "tiny-random", "messages": ['), None),
    "body not an object": ((CHAT, [1, 2]), None),
    "unknown model": (chat(model="gpt-4o"), "model", 404),
    "no messages": ((CHAT, {"model": MODEL}), "messages"),
    "empty messages": (chat(messages=[]), "messages"),
    "message without role": (chat(messages=[{"content": "hi"}]), "messages[0].role"),
    "unknown role": (chat(messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
    "content not a string": (
        chat(messages=[{"role": "user", "content": 7}]),
        "messages[0].content",
    ),
    "messages a string": (chat(messages="hi"), "messages"),
    "max_tokens a string": (chat(max_tokens="ten"), "max_tokens"),
    "temperature a string": (chat(temperature="hot"), "temperature"),
    "stream a string": (chat(stream="yes"), "stream"),
    "max_tokens 0": (chat(max_tokens=0), "max_tokens"),
    "max_tokens past the context": (chat(max_tokens=MAX_LEN), "max_tokens"),
    "max_completion_tokens past it": (chat(max_completion_tokens=10**6), "max_completion_tokens"),
    "temperature -1": (chat(temperature=-1), "temperature"),
    "top_p 0": (chat(top_p=0), "top_p"),
    "top_p 1.5": (chat(top_p=1.5), "top_p"),
    "top_k 0": (chat(top_k=0), "top_k"),
    "empty stop string": (chat(stop=[""]), "stop"),
    "n=2": (chat(n=2), "n"),
    "messages too long": (chat(messages=[{"role": "user", "content": LONG}]), "messages"),
    "prompt too long": (complete(prompt=LONG), "prompt"),
    "empty prompt": (complete(prompt=""), "prompt"),
    "token id out of vocab": (complete(prompt=[1, 10**6]), "prompt"),
    "batch of prompts": (complete(prompt=["a", "b"]), "prompt"),
    "streamed, max_tokens 0": (complete(stream=True, max_tokens=0), "max_tokens"),
    "top_logprobs without logprobs": (chat(top_logprobs=2), "top_logprobs"),
    "top_logprobs 21": (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "logprobs a string": (chat(logprobs="yes"), "logprobs"),
    "completion logprobs -1": (complete(logprobs=-1), "logprobs"),
}


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input(server: tuple[int, Spy], case: str) -> None:
    (path, body), param, *status = BAD_INPUT[case]
    port, spy = server
    calls = spy.calls
    got_status, got = call(port, "POST", path, body)
    assert got_status == (status[0] if status else 400), got
    error = got["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]
    assert spy.calls == calls  # rejected before the backend saw it


def test_bad_input_through_the_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=USER)
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=USER, temperature=-1, stream=True)
    assert bad.value.type == "invalid_request_error" and bad.value.param == "temperature"


def test_unknown_fields_are_ignored(server: tuple[int, Spy]) -> None:
    body = {**OK, "max_tokens": 2, "frequency_penalty": 0, "user": "u1", "tools": None}
    assert call(server[0], "POST", CHAT, body)[0] == 200


def test_chat_logprobs_match_the_engine(client: openai.OpenAI, backend: LocalBackend) -> None:
    """Each generated token's logprob and its top alternatives are the engine's own, named
    by their text; greedy picks the best of them."""
    out = client.chat.completions.create(
        model=MODEL, messages=USER, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 12
    ids = backend.tokenize_chat(USER)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    want = backend.worker.generate(ids, params)
    for item, tok, entry in zip(content, want.token_ids, want.logprobs, strict=True):
        assert item.token == backend.token_texts([tok])[0]
        assert item.logprob == pytest.approx(entry[tok], abs=1e-5)
        assert item.bytes == list(item.token.encode())
        assert len(item.top_logprobs) == 3
        tops = [t.logprob for t in item.top_logprobs]
        assert tops == sorted(tops, reverse=True) and max(tops) == pytest.approx(item.logprob)
        assert all(lp <= 0 for lp in tops)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon", logprobs=2, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(12)]
    for lp_i, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(lp_i)
    plain = client.completions.create(model=MODEL, prompt="Once upon", **GREEDY)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == out.choices[0].text


def test_streamed_logprobs_equal_the_non_streamed(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 2, **GREEDY}
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    chunks = [c for c in client.chat.completions.create(stream=True, **kw) if c.choices]
    streamed = [
        item for c in chunks if c.choices[0].logprobs for item in c.choices[0].logprobs.content
    ]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in whole]
    assert [len(i.top_logprobs) for i in streamed] == [2] * 12

    kw = {"model": MODEL, "prompt": "Once upon", "logprobs": 1, **GREEDY}
    whole_text = client.completions.create(**kw).choices[0].logprobs
    pieces = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)]
    pieces = [p for p in pieces if p is not None]
    assert [t for p in pieces for t in p.tokens] == whole_text.tokens
    assert [o for p in pieces for o in p.text_offset] == whole_text.text_offset


# -- keys, metrics, disconnects, failures ------------------------------------------------------


def test_api_key(backend: LocalBackend) -> None:
    with serve(build_api(backend, model_name=MODEL, api_key="s3cret")) as port:
        status, body = call(port, "GET", "/v1/models")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        assert e.value.type == "authentication_error"
        right = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert [m.id for m in right.models.list()] == [MODEL]
        assert right.completions.create(model=MODEL, prompt="a", max_tokens=2).usage
        assert call(port, "GET", "/health") == (200, {"status": "ok"})


def test_metrics(client: openai.OpenAI, server: tuple[int, Spy]) -> None:
    client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, stream=True).close()
    list(client.completions.create(model=MODEL, prompt="metrics", max_tokens=3, stream=True))
    call(server[0], "POST", CHAT, {**OK, "n": 3})
    status, text = call(server[0], "GET", "/metrics")
    assert status == 200
    for line in (
        'kvmesh_requests_total{route="/v1/completions",status="200"}',
        'kvmesh_requests_total{route="/v1/chat/completions",status="400"}',
        "kvmesh_generated_tokens_total",
        'kvmesh_prompt_tokens_total{source="local_hit"}',
        'kvmesh_prompt_tokens_total{source="computed"}',
        "kvmesh_time_to_first_token_seconds_count",
        "kvmesh_inter_token_latency_seconds_count",
        'kvmesh_worker_running{worker="local-0"}',
        'kvmesh_worker_waiting{worker="local-0"}',
    ):
        assert line in text, line
    count = [
        ln for ln in text.splitlines() if ln.startswith("kvmesh_inter_token_latency_seconds_count")
    ]
    assert float(count[0].split()[-1]) >= 2


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_aborts(
    server: tuple[int, Spy], backend: LocalBackend, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    engine = backend.worker.engine
    aborted: list[str] = []
    abort, step = engine.abort, engine.step

    def slow_step() -> Any:
        time.sleep(0.01)  # a full answer now takes seconds: the disconnect must come first
        return step()

    def spy_abort(rid: str, reason: str | None = None) -> None:
        aborted.append(rid)
        abort(rid, reason)

    monkeypatch.setattr(engine, "abort", spy_abort)
    monkeypatch.setattr(engine, "step", slow_step)
    _, body = complete(max_tokens=MAX_LEN - 2, ignore_eos=True, stream=stream)
    conn = http.client.HTTPConnection("127.0.0.1", server[0], timeout=30)
    conn.request("POST", COMPLETIONS, json.dumps(body), {"Content-Type": "application/json"})
    if stream:
        response = conn.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    else:
        wait_until(lambda: backend.worker.load()["running"] == 1, "the request to run")
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: len(aborted) == 1, "the abort", timeout=5)
    wait_until(lambda: not backend.worker.call(engine.request_ids), "the engine to drain")


class Broken:
    """A backend whose engine fails: generate raises; a stream fails after one chunk."""

    model_name, max_model_len = MODEL, MAX_LEN

    def tokenize(self, prompt: Any) -> list[int]:
        return [1, 2, 3]

    def tokenize_chat(self, messages: Any) -> list[int]:
        return [1, 2, 3]

    async def generate(self, request: GenerateRequest) -> Completion:
        raise RuntimeError("engine on fire")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        yield Chunk(request.request_id, "a", [97])
        raise RuntimeError("engine on fire")

    async def stats(self) -> dict[str, Any]:
        raise RuntimeError("no stats either")


def test_backend_failures_are_500s_and_stream_errors() -> None:
    with serve(build_api(Broken(), model_name=MODEL)) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL, messages=USER)
        assert e.value.status_code == 500 and e.value.type == "server_error"
        got = []
        with pytest.raises(openai.APIError, match="engine on fire"):
            for chunk in client.completions.create(model=MODEL, prompt="a", stream=True):
                got.append(chunk.choices[0].text)
        assert got == ["a"]
        status, text = call(port, "GET", "/metrics")
        assert status == 200 and 'status="500"' in text


@pytest.mark.parametrize("stream", [False, True])
def test_request_larger_than_the_pool_is_a_400(stream: bool) -> None:
    """Only the engine knows its pool: its admission error still comes back as a 400, also
    for a stream (headers wait for the first chunk)."""
    small = LocalBackend(model=MODEL, block_size=4, num_kv_blocks=8, progress=False)
    try:
        with serve(build_api(small, model_name=MODEL)) as port:
            status, body = call(port, "POST", *chat(max_tokens=100, stream=stream))
            assert status == 400 and body["error"]["type"] == "invalid_request_error"
            assert "KV cache" in body["error"]["message"]
    finally:
        small.shutdown()
