"""The Serve app on real Ray through the Python handle (``IngressHandle``): ``generate``,
``chat`` and ``completions`` with OpenAI's bodies (equal to HTTP), their errors raised as the
ingress raised them, a stream its caller cancels. The rest of the app: test_serving.py."""

from __future__ import annotations

import re

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.ingress_handle import IngressHandle
from kvmesh.cluster.serve_app import app_handle
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import (
    busy_worker,
    check_prompt_logprobs,
    replica_log,
    tiny_reference,
    undeploy,
    unified_app,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def unified():
    yield unified_app()
    undeploy()


@pytest.fixture(scope="module")
def reference() -> LLM:
    return tiny_reference()


def test_handle_generate_and_stream(unified, reference: LLM) -> None:
    handle, _, _ = unified
    req = {"prompt": list(range(1, 40)), "max_tokens": 6, "temperature": 0}
    out = handle.generate.remote(req).result()
    want = reference.generate([list(range(1, 40))], SamplingParams(max_tokens=6, temperature=0))
    assert out["token_ids"] == want[0].token_ids
    # A running app's handle, as a driver that did not deploy it gets it: deploy's kind.
    running = app_handle()
    assert isinstance(running, IngressHandle)
    assert running.generate.remote(req).result()["token_ids"] == out["token_ids"]
    assert out["kvmesh"]["worker"].startswith("worker-")
    chunks = list(handle.options(stream=True).generate.remote({**req, "stream": True}))
    assert [t for c in chunks for t in c["token_ids"]] == out["token_ids"]
    assert chunks[-1]["finish_reason"] == out["finish_reason"]
    assert "kvmesh" in chunks[-1]
    assert out["logprobs"] is None
    with_lp = handle.generate.remote({**req, "logprobs": 2}).result()
    assert with_lp["token_ids"] == out["token_ids"]
    lps = with_lp["logprobs"]
    assert len(lps) == len(out["token_ids"])
    for tok, entry in zip(out["token_ids"], lps, strict=True):
        assert tok in entry and 2 <= len(entry) <= 3
    streamed = handle.options(stream=True).generate.remote({**req, "logprobs": 2, "stream": True})
    assert [e for c in streamed for e in c.get("logprobs", [])] == lps


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        ({"prompt": 5}, "prompt"),  # was Ray's TypeError: 'int' object is not iterable
        ({"prompt": [1, -2]}, "prompt[1]"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"prompt": "hi", "max_tokens": 10**9}, "max_tokens"),  # refused by the backend
        ({"prompt": "hi", "bogus": 1}, "bogus"),
    ],
)
def test_handle_generate_refuses_bad_input_as_the_callers_error(unified, request_, param) -> None:
    """A ValueError naming the field and a 400 ApiError, its message the check's own, not
    Ray's traceback with the replica's pid and actor id (before: RayTaskError(ValueError),
    a TypeError for a wrong prompt type, and an ERROR with a traceback in the replica's log);
    streamed too; the replica logs one INFO line."""
    handle, _, _ = unified
    for stream in (False, True):
        with pytest.raises(ValueError, match=rf"^{re.escape(param)}: ") as e:
            if stream:
                list(handle.options(stream=True).generate.remote({**request_, "stream": True}))
            else:
                handle.generate.remote(request_).result(timeout_s=60)
        assert isinstance(e.value, ApiError) and e.value.status == 400
        assert e.value.body["error"]["param"] == param
        assert "pid=" not in str(e.value) and "Traceback" not in str(e.value)
    line = f"Refused with 400: {param}:"
    wait_for(lambda: line in replica_log("KvmeshServer"), 10, "the replica's INFO line")


def test_handle_generate_bans_bad_words(unified) -> None:
    """The handle's plain form carries words, not token ids (tiny-random's token 113 is
    "q"); through the cluster they are banned, and the mask beats a +100 bias."""
    handle, _, _ = unified
    q = ord("q")
    req = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
           "logit_bias": {q: 100}}  # fmt: skip
    assert handle.generate.remote(req).result()["token_ids"] == [q] * 4
    out = handle.generate.remote({**req, "bad_words": ["q"]}).result()
    assert q not in out["token_ids"] and len(out["token_ids"]) == 4


def test_handle_speaks_openai_bodies(unified, reference: LLM) -> None:
    """``handle.completions`` / ``handle.chat`` take the HTTP body as a dict and give the
    HTTP JSON: several choices, streams with usage, and the same 400s, raised."""

    handle, client, config = unified
    body = {"model": config.model_name, "prompt": ["Once upon", "Hello"], "n": 2}
    body |= {"max_tokens": 10, "temperature": 0}
    over_http = client.completions.create(**body).model_dump(exclude_unset=True)
    out = handle.completions.remote(body).result()
    assert out["object"] == "text_completion" and len(out["choices"]) == 4
    assert [c["text"] for c in out["choices"]] == [c["text"] for c in over_http["choices"]]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # not what was cached
    assert {k: out["usage"][k] for k in counts} == {k: over_http["usage"][k] for k in counts}
    chat = {"model": config.model_name, "messages": [{"role": "user", "content": "Hi"}]}
    chat |= {"max_tokens": 8, "temperature": 0, "n": 2}
    answer = handle.chat.remote(chat).result()
    texts = [c["message"]["content"] for c in answer["choices"]]
    assert texts[0] == texts[1]
    stream = {**chat, "stream": True, "stream_options": {"include_usage": True}}
    chunks = list(handle.options(stream=True).chat.remote(stream))
    streamed = ["", ""]
    for c in chunks[:-1]:
        streamed[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content") or ""
    assert streamed == texts
    assert {k: chunks[-1]["usage"][k] for k in counts} == {k: answer["usage"][k] for k in counts}
    with pytest.raises(ApiError) as bad:
        handle.chat.remote({**chat, "temperature": float("nan")}).result()
    assert bad.value.status == 400 and "not JSON" in bad.value.body["error"]["message"]
    with pytest.raises(ApiError) as bad:
        handle.completions.remote({**body, "n": 0}).result()
    assert bad.value.status == 400 and bad.value.body["error"]["param"] == "n"
    # logit_bias and the penalties reach the engine actors (tests/test_penalties.py: what
    # they do); a token past the vocabulary is the caller's 400.
    forced = {**chat, "n": 1, "logit_bias": {"42": 100}, "presence_penalty": -1}
    out = handle.chat.remote(forced).result()
    text = out["choices"][0]["message"]["content"]
    assert out["usage"]["completion_tokens"] == 8 and text and text == text[: len(text) // 8] * 8
    assert client.chat.completions.create(**forced).choices[0].message.content == text
    with pytest.raises(ApiError) as bad:
        handle.chat.remote({**chat, "logit_bias": {"99999": 1}}).result()
    assert bad.value.status == 400 and bad.value.body["error"]["param"] == "logit_bias"
    assert handle.ingress_stats.remote().result()["admitted"] == 0
    # Tool calls: the handle's chat answers them as HTTP does.
    tools = [{"type": "function", "function": {"name": "now"}}]
    named = {"type": "function", "function": {"name": "now"}}
    called = handle.chat.remote({**chat, "n": 1, "tools": tools, "tool_choice": named}).result()
    message = called["choices"][0]["message"]
    assert message["content"] is None and called["choices"][0]["finish_reason"] == "stop"
    assert message["tool_calls"][0]["function"] == {"name": "now", "arguments": "{}"}
    # Prompt logprobs (echo with logprobs) cross the actors, computed where it decodes.
    check_prompt_logprobs(handle, reference, config.model_name)
    # The caller's errors are one INFO line each in the replica's log, not ERROR tracebacks.
    wait_for(lambda: "Refused with 400: n:" in replica_log("KvmeshServer"), 10, "the log line")
    assert "kvmesh.cluster.api_error.ApiError" not in replica_log("KvmeshServer")


def test_a_handle_stream_its_caller_cancels_aborts_every_choice(unified) -> None:
    handle, _, config = unified
    body = {"model": config.model_name, "prompt": "Once", "max_tokens": 2000, "n": 2}
    stream = handle.options(stream=True).completions.remote(
        {**body, "ignore_eos": True, "stream": True}
    )
    next(stream)
    assert busy_worker(handle) is not None
    stream.cancel()
    wait_for(lambda: busy_worker(handle) is None, 15, "the workers to abort both choices")
    wait_for(lambda: handle.ingress_stats.remote().result()["admitted"] == 0, 5, "places back")
