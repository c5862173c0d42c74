"""The OpenAI API over a real engine (LocalBackend, tiny-random), served by uvicorn on
loopback and driven by the official ``openai`` client; bad input through raw HTTP."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from tests.api_helpers import CHAT, chat, complete
from tests.openai_helpers import (
    GREEDY,
    MAX_LEN,
    MODEL,
    USER,
    Spy,
    call,
    check_kvmesh,
    serve,
)

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


def test_a_model_is_retrieved_by_name(client: openai.OpenAI, server: tuple[int, Spy]) -> None:
    """OpenAI's GET /v1/models/{model}: the served model's card, a 404 for any other name."""
    (listed,) = client.models.list().data
    assert client.models.retrieve(MODEL) == listed
    for other in ("gpt-4", "org/" + MODEL, MODEL.upper()):
        with pytest.raises(openai.NotFoundError) as e:
            client.models.retrieve(other)
        assert e.value.code == "model_not_found" and repr(other) in e.value.message
    status, body = call(server[0], "GET", "/v1/models/a/b%20c")
    assert status == 404 and body["error"]["param"] == "model"


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

OK = {"model": MODEL, "messages": USER}


LONG = "x" * MAX_LEN
IMAGE = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
PART = "messages[0].content[0]"
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
    "messages too long": (chat(messages=[{"role": "user", "content": LONG}]), "messages"),
    "prompt too long": (complete(prompt=LONG), "prompt"),
    "empty prompt": (complete(prompt=""), "prompt"),
    "token id out of vocab": (complete(prompt=[1, 10**6]), "prompt"),
    "streamed, max_tokens 0": (complete(stream=True, max_tokens=0), "max_tokens"),
    "top_logprobs without logprobs": (chat(top_logprobs=2), "top_logprobs"),
    "top_logprobs 21": (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    "logprobs a string": (chat(logprobs="yes"), "logprobs"),
    # A union's error names the member the value was meant for (a list of parts), not "str".
    "an image part": (chat(messages=[{"role": "user", "content": [IMAGE]}]), PART + ".type"),
    "a text part without text": (
        chat(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        PART + ".text",
    ),
    "completion logprobs -1": (complete(logprobs=-1), "logprobs"),
    "empty cache_salt": (chat(cache_salt=""), "cache_salt"),
    "cache_salt a number": (complete(cache_salt=7), "cache_salt"),
    "stop_token_ids not a list": (chat(stop_token_ids=5), "stop_token_ids"),
    "stop_token_id negative": (complete(stop_token_ids=[-1]), "stop_token_ids"),
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


# -- keys, metrics, disconnects, failures ------------------------------------------------------


def test_api_key(backend: LocalBackend) -> None:
    with serve(build_api(backend, model_name=MODEL, api_key="s3cret")) as port:
        for path in ("/v1/models", f"/v1/models/{MODEL}", "/v1/models/other"):
            status, body = call(port, "GET", path)
            assert status == 401 and body["error"]["type"] == "authentication_error"
        base = f"http://127.0.0.1:{port}/v1"
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=base, api_key="wrong", max_retries=0).models.list()
        assert e.value.type == "authentication_error"
        right = openai.OpenAI(base_url=base, api_key="s3cret", max_retries=0)
        assert [m.id for m in right.models.list()] == [MODEL]
        assert right.models.retrieve(MODEL).id == MODEL
        assert right.completions.create(model=MODEL, prompt="a", max_tokens=2).usage
        assert call(port, "GET", "/health") == (200, {"status": "ok"})


def test_metrics_need_the_api_key_when_one_is_set(backend: LocalBackend) -> None:
    with serve(build_api(backend, model_name=MODEL, api_key="s3cret")) as port:
        status, body = call(port, "GET", "/metrics")
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, body = call(port, "GET", "/metrics", Authorization="Bearer wrong")
        assert status == 401
        status, text = call(port, "GET", "/metrics", Authorization="Bearer s3cret")
        assert status == 200 and "kvmesh_requests_total" in text
        assert call(port, "GET", "/health") == (200, {"status": "ok"})  # probes carry no key
    with serve(build_api(backend, model_name=MODEL)) as port:  # no key: open, as before
        status, text = call(port, "GET", "/metrics")
        assert status == 200 and "kvmesh_requests_total" in text


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


class Broken:
    """A backend whose engine fails: generate raises; a stream fails after one chunk."""

    model_name, max_model_len, vocab_size = MODEL, MAX_LEN, 256

    def tokenize(self, prompt: Any) -> list[int]:
        return [1, 2, 3]

    def tokenize_chat(self, messages: Any, **template: bool) -> list[int]:
        return [1, 2, 3]

    async def generate(self, request: GenerateRequest) -> Completion:
        raise RuntimeError("engine on fire")

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        yield Chunk(request.request_id, "a", [97])
        raise RuntimeError("engine on fire")

    async def stats(self) -> dict[str, Any]:
        raise RuntimeError("no stats either")


def test_backend_failures_are_500s_and_stream_errors(caplog: pytest.LogCaptureFixture) -> None:
    """A failure is a 500 (or an error event in a started stream) that says nothing
    internal; the detail goes to the server's log, under the reference the message gives."""
    with serve(build_api(Broken(), model_name=MODEL)) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            client.chat.completions.create(model=MODEL, messages=USER)
        assert e.value.status_code == 500 and e.value.type == "server_error"
        assert "fire" not in e.value.message and "ref " in e.value.message
        got = []
        with pytest.raises(openai.APIError, match="internal server error") as streamed:
            for chunk in client.completions.create(model=MODEL, prompt="a", stream=True):
                got.append(chunk.choices[0].text)
        assert got == ["a"] and "fire" not in streamed.value.message
        ref = streamed.value.message.split("ref ")[1].rstrip(")")
        assert any(ref in r.getMessage() and r.exc_info for r in caplog.records)
        status, text = call(port, "GET", "/metrics")
        assert status == 200 and 'status="500"' in text


@pytest.mark.parametrize("stream", [False, True])
def test_request_larger_than_the_pool_is_a_400(stream: bool) -> None:
    """A pool smaller than the model's context caps the context the API serves: /v1/models
    says so, a request beyond it is a 400 naming max_tokens (also for a stream), and one
    without max_tokens fits (before: a 400 for every chat without max_tokens)."""
    small = LocalBackend(model=MODEL, block_size=4, num_kv_blocks=32, progress=False)
    try:
        with serve(build_api(small, model_name=MODEL)) as port:
            status, models = call(port, "GET", "/v1/models")
            assert status == 200 and models["data"][0]["max_model_len"] == 128
            status, body = call(port, "POST", *chat(max_tokens=200, stream=stream))
            assert status == 400 and body["error"]["type"] == "invalid_request_error"
            assert body["error"]["param"] == "max_tokens"
            assert "context of 128 tokens" in body["error"]["message"]
            status, body = call(port, "POST", *chat(stream=stream))
            assert status == 200, body
    finally:
        small.shutdown()
