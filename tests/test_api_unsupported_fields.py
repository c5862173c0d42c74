"""OpenAI fields kvmesh does not implement are refused, not silently ignored: each is accepted
only at the value that asks for nothing (``best_of: 1``, ``functions: []``, ...), and
anything else is a 400 naming the field (a wrong type or a value out of OpenAI's range too);
``stream_options`` needs ``stream: true``; ``/openapi.json`` declares just the accepted values.
Also: the ``Authorization`` scheme is case-insensitive (RFC 7235), the key is not.

Served by uvicorn on loopback over a LocalBackend on tiny-random (conftest.py's ``server``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from tests.api_helpers import CHAT, COMPLETIONS, assert_bad, chat, complete, sse_events
from tests.openai_helpers import MODEL, Spy, call, serve

Make = Callable[..., tuple[str, Any]]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
# case: (route, field, values refused as not supported, values accepted: those that ask for
# nothing). (The penalties and logit_bias are served: test_penalties.py; tools:
# test_tool_calls.py.)
FIELDS: dict[str, tuple[Make, str, list[Any], list[Any]]] = {
    "best_of": (complete, "best_of", [2, 20], [1, None]),
    "suffix": (complete, "suffix", ["!", " the end"], [None, ""]),
    "functions (deprecated)": (chat, "functions", [[TOOL["function"]]], [[], None]),
    "function_call (deprecated)": (chat, "function_call", ["auto", {"name": "f"}], ["none", None]),
}
# vLLM's extensions kvmesh does not implement (vllm_extras.py): refused the same way, on both
# routes unless chat's alone, rather than ignored as unknown fields are. (allowed_token_ids
# and bad_words are served: test_allowed_bad_words.py; skip_special_tokens and
# truncate_prompt_tokens: test_api_vllm_extensions.py; response_format and the structured
# outputs: test_structured_outputs.py.)
VLLM_FIELDS: dict[str, tuple[list[Any], list[Any]]] = {  # field: (refused, accepted)
    "use_beam_search": ([True], [False, None]),
    "length_penalty": ([0.5, 2], [1, 1.0, None]),
    "logits_processors": ([["my.module:Proc"]], [[], None]),
    "structural_tag": (["{}"], [None]),
    "priority": ([1, -5], [0, None]),
    "prompt_logprobs": ([0, 5], [None]),
    "return_tokens_as_token_ids": ([True], [False, None]),
    "kv_transfer_params": ([{"do_remote_prefill": True}], [None]),
    "vllm_xargs": ([{"k": 1}], [{}, None]),
}
for _field, (_refused, _accepted) in VLLM_FIELDS.items():
    for _make in (chat, complete):
        FIELDS[f"{_field} ({_make.__name__})"] = (_make, _field, _refused, _accepted)
for _field, (_refused, _accepted) in {
    "echo": ([True], [False, None]),
    "chat_template": (["{{ messages }}"], [None]),
    "chat_template_kwargs": ([{"enable_thinking": False}], [{}, None]),
    "documents": ([[{"title": "t", "text": "x"}]], [[], None]),
    "mm_processor_kwargs": ([{"k": 1}], [{}, None]),
    "add_special_tokens": ([True], [False, None]),
}.items():
    FIELDS[f"{_field} (chat)"] = (chat, _field, _refused, _accepted)


@pytest.mark.parametrize("case", FIELDS)
def test_an_unsupported_field_is_refused_unless_it_asks_for_nothing(
    server: tuple[int, Spy], case: str
) -> None:
    make, field, refused, accepted = FIELDS[case]
    port, spy = server
    calls = spy.calls
    for value in refused:
        status, body = call(port, "POST", *make(**{field: value}))
        assert_bad(status, body, field)
        assert "kvmesh does not support" in body["error"]["message"], (value, body)
    assert spy.calls == calls  # refused before the backend saw anything
    for value in accepted:
        status, body = call(port, "POST", *make(max_tokens=1, **{field: value}))
        assert status == 200, (value, body)


@pytest.mark.parametrize("make", [chat, complete], ids=["chat", "completions"])
def test_allowed_token_ids_and_bad_words_are_served(server: tuple[int, Spy], make: Make) -> None:
    """Refused here until kvmesh served them (test_allowed_bad_words.py): the values once
    refused are answered, and an empty allowed_token_ids is a 400 for what it asks (nothing
    could be chosen, as vLLM says), not as a field kvmesh lacks."""
    port, _ = server
    for field, value in (("allowed_token_ids", [1, 2]), ("bad_words", ["the"])):
        status, body = call(port, "POST", *make(max_tokens=1, **{field: value}))
        assert status == 200, (field, body)
    status, body = call(port, "POST", *make(allowed_token_ids=[]))
    assert_bad(status, body, "allowed_token_ids")
    assert "kvmesh does not support" not in body["error"]["message"], body


# case: (request, param): a wrong type, or out of OpenAI's range
INVALID: dict[str, tuple[tuple[str, Any], str]] = {
    "best_of 0": (complete(best_of=0), "best_of"),
    "best_of a string": (complete(best_of="1"), "best_of"),
    "echo a string": (complete(echo="false"), "echo"),
    "suffix a number": (complete(suffix=1), "suffix"),
    "response_format a string": (chat(response_format="json_object"), "response_format"),
    "response_format an unknown type": (
        chat(response_format={"type": "xml"}),
        "response_format.type",
    ),
    "tools an object": (chat(tools=TOOL), "tools"),
    "tool_choice a number": (chat(tool_choice=1), "tool_choice"),
    "parallel_tool_calls a string": (chat(parallel_tool_calls="yes"), "parallel_tool_calls"),
}


@pytest.mark.parametrize("case", INVALID)
def test_an_unsupported_field_of_the_wrong_type_or_range_is_a_400(
    server: tuple[int, Spy], case: str
) -> None:
    (path, body), param = INVALID[case]
    port, spy = server
    calls = spy.calls
    assert_bad(*call(port, "POST", path, body), param)
    assert spy.calls == calls


def test_parallel_tool_calls_asks_for_nothing_without_tools(server: tuple[int, Spy]) -> None:
    # OpenAI's default is true; with no tools either value changes nothing, so both pass.
    for value in (True, False, None):
        status, body = call(server[0], "POST", *chat(max_tokens=1, parallel_tool_calls=value))
        assert status == 200, (value, body)
    assert_bad(*call(server[0], "POST", *chat(parallel_tool_calls=1)), "parallel_tool_calls")


@pytest.mark.parametrize("make", [chat, complete], ids=["chat", "completions"])
def test_stream_options_need_stream_true(server: tuple[int, Spy], make: Make) -> None:
    port, spy = server
    calls = spy.calls
    options = {"include_usage": True}
    for stream in ({}, {"stream": False}):
        status, body = call(port, "POST", *make(stream_options=options, **stream))
        assert_bad(status, body, "stream_options")
    assert spy.calls == calls
    status, body = call(port, "POST", *make(max_tokens=1, stream=False, stream_options=None))
    assert status == 200, body
    path, request = make(max_tokens=1, stream=True, stream_options=options)
    status, events = sse_events(port, path, request)
    assert status == 200 and events[-1]["usage"]["completion_tokens"] == 1, events


def test_openapi_declares_only_the_accepted_values(server: tuple[int, Spy]) -> None:
    """So a client (or schemathesis) that follows the schema sends what is answered."""
    status, schema = call(server[0], "GET", "/openapi.json")
    assert status == 200
    models = schema["components"]["schemas"]
    chat_fields = models["ChatCompletionRequest"]["properties"]
    completion_fields = models["CompletionRequest"]["properties"]
    null = {"type": "null"}
    assert completion_fields["best_of"]["anyOf"] == [{"const": 1}, null]
    assert completion_fields["suffix"]["anyOf"] == [{"const": ""}, null]
    assert chat_fields["functions"]["anyOf"] == [{"type": "array", "maxItems": 0}, null]
    assert chat_fields["function_call"]["anyOf"] == [{"const": "none"}, null]
    # tool_choice: "auto" is refused (test_tool_calls.py), and tools need a tool_choice
    assert chat_fields["tool_choice"]["anyOf"][0] == {"enum": ["none", "required"]}
    no_tools, choice = models["ChatCompletionRequest"]["allOf"][1]["anyOf"]
    assert choice["required"] == ["tool_choice"]
    assert {"type": "null"} in no_tools["properties"]["tools"]["anyOf"]
    needs_stream = {"properties": {"stream": {"const": True}}, "required": ["stream"]}
    chat_conditions = models["ChatCompletionRequest"]["allOf"][0]
    for conditions in (chat_conditions, models["CompletionRequest"]):  # options need stream
        assert needs_stream in conditions["anyOf"]
    assert {CHAT, COMPLETIONS} <= set(schema["paths"])


def test_the_authorization_scheme_is_case_insensitive(backend: LocalBackend) -> None:
    """RFC 7235: the scheme ("Bearer") is case-insensitive; the key itself is not."""
    with serve(build_api(backend, model_name=MODEL, api_key="s3cret")) as port:
        for header in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "bEaReR s3cret"):
            status, body = call(port, "GET", "/v1/models", Authorization=header)
            assert status == 200, (header, body)
        status, _ = call(port, "GET", "/metrics", Authorization="bearer s3cret")
        assert status == 200
        for header in ("bearer S3CRET", "Bearer S3cret", "Basic s3cret", "bearers3cret", "s3cret"):
            status, body = call(port, "GET", "/v1/models", Authorization=header)
            assert status == 401 and body["error"]["type"] == "authentication_error", header
