"""Tool calls on chat (``cluster/tool_calls.py``): ``tool_choice`` "required" or a named
function answered as ``tool_calls`` whose arguments fit each tool's schema, streamed as
OpenAI's deltas that join to the same calls, through the official client (tiny-random: its
tokens are bytes, so any JSON can be spelled); "auto" and malformed tools refused with a 400
naming the field, before the backend sees anything; earlier calls and tool results in the
conversation go to the chat template. The real model's call: test_real_model.py."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.cluster.response_models import ChatCompletionChunk, ChatCompletionResponse
from kvmesh.cluster.tool_calls import (
    FunctionDefinition,
    ToolCallDeltas,
    ToolCalling,
)
from tests.api_helpers import assert_bad, chat, sse_events
from tests.openai_helpers import MODEL, USER, Spy, call

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 6},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
LIGHTS = {
    "type": "function",
    "function": {
        "name": "lights",
        "parameters": {
            "type": "object",
            "properties": {"on": {"type": "boolean"}},
            "required": ["on"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
# Their calls' schema is past the 64 KiB a structured output may have.
BIG = [
    {
        "type": "function",
        "function": {
            "name": f"big{k}",
            "parameters": {"properties": {f"p{i}": {"description": "x" * 100} for i in range(100)}},
        },
    }
    for k in range(10)
]  # no parameters: arguments "{}"
TOOLS = [WEATHER, LIGHTS, NOW]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(calls: list[Any]) -> None:
    """Each call names a tool and its arguments fit the tool's schema."""
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_"), c
        args = json.loads(c.function.arguments)
        schema = SCHEMAS[c.function.name]
        jsonschema.validate(args, schema if schema is not None else {"maxProperties": 0})


def joined(chunks: list[Any]) -> tuple[list[dict[str, str]], str | None]:
    """The calls a stream's deltas make (by index: name once, arguments joined), and its
    finish_reason."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in chunks:
        for choice in chunk.choices:
            assert choice.delta.content in (None, ""), chunk
            for d in choice.delta.tool_calls or []:
                if d.id is not None:  # a call's first delta
                    assert d.index not in calls and d.function.name, d
                    calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    return [calls[k] for k in sorted(calls)], finish


# -- reading calls as the text comes -------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.sampled_from(["f", "g_2", "h-3"]), st.dictionaries(st.text(), JSON)),
        min_size=1,
        max_size=3,
    ),
    cuts=st.lists(st.integers(min_value=1, max_value=8), min_size=1),
)
def test_streamed_deltas_join_to_the_calls(calls: list[tuple[str, dict]], cuts: list[int]):
    """The answer cut anywhere (inside strings with braces, quotes and escapes too): the
    deltas make the calls the whole text holds, each argument text exactly the model's."""
    dumps = [json.dumps(args, separators=(",", ":")) for _, args in calls]
    text = json.dumps([{"name": n, "parameters": a} for n, a in calls], separators=(",", ":"))
    calling = ToolCalling(tuple(FunctionDefinition(name=n) for n in ("f", "g_2", "h-3")))
    whole = calling.calls(text)
    assert [(c.name, c.arguments) for c in whole] == [
        (n, d) for (n, _), d in zip(calls, dumps, strict=True)
    ]
    deltas, at, i = ToolCallDeltas(calling), 0, 0
    got: dict[int, list[str]] = {}
    while at < len(text):
        step = cuts[i % len(cuts)]
        for d in deltas.add(text[at : at + step]):
            if "id" in d:
                got[d["index"]] = [d["function"]["name"], d["function"]["arguments"]]
            else:
                got[d["index"]][1] += d["function"]["arguments"]
        at, i = at + step, i + 1
    assert [tuple(got[k]) for k in sorted(got)] == [
        (n, d) for (n, _), d in zip(calls, dumps, strict=True)
    ]


def test_a_named_function_is_the_whole_answer() -> None:
    calling = ToolCalling((FunctionDefinition(name="f"),), named="f")
    deltas = ToolCallDeltas(calling)
    first, more = deltas.add('{"a":'), deltas.add("1}")
    assert first[0]["function"] == {"name": "f", "arguments": '{"a":'} and first[0]["index"] == 0
    assert more == [{"index": 0, "function": {"arguments": "1}"}}]
    assert calling.finish_reason("stop") == "stop"  # forced, as OpenAI says
    assert ToolCalling(calling.tools).finish_reason("stop") == "tool_calls"
    assert ToolCalling(calling.tools).finish_reason("length") == "length"


# -- over HTTP, with the official client ---------------------------------------------------


@pytest.mark.parametrize("parallel", [None, False])
def test_required_answers_with_calls_that_fit(client, parallel: bool | None) -> None:
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    done = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0.9,
        seed=3,
        **extra,
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls", done
    assert choice.message.content is None, done
    check_calls(choice.message.tool_calls)
    if parallel is False:
        assert len(choice.message.tool_calls) == 1


def test_a_named_function_is_called(client) -> None:
    done = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=60, temperature=0.9
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop", done
    (only,) = choice.message.tool_calls
    assert only.function.name == "get_weather"
    check_calls([only])


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_stream_makes_the_same_calls(client, choice: Any) -> None:
    """Greedy: the stream's deltas join to the non-streamed answer's calls (ids apart), and
    every chunk fits OpenAI's chunk model (the client parses each)."""
    kw = {"model": MODEL, "messages": USER, "tools": TOOLS, "tool_choice": choice}
    kw |= {"max_tokens": 120, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    calls, finish = joined(list(client.chat.completions.create(stream=True, **kw)))
    assert finish == whole.choices[0].finish_reason
    want = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert want and finish in ("stop", "tool_calls"), whole
    assert [(c["name"], c["arguments"]) for c in calls] == want
    assert all(c["id"].startswith("call_") for c in calls)


def test_the_answers_fit_the_documented_models(server) -> None:
    """The response and every stream chunk, as sent, fit ``response_models.py`` exactly
    (the OpenAPI schema; extra keys are refused there)."""
    fields = {"tools": TOOLS, "tool_choice": "required", "max_tokens": 60, "temperature": 0.9}
    status, body = call(server[0], "POST", *chat(**fields))
    assert status == 200, body
    ChatCompletionResponse.model_validate(body)
    assert body["choices"][0]["message"]["tool_calls"], body
    status, events = sse_events(server[0], *chat(stream=True, **fields))
    assert status == 200
    for event in events:
        ChatCompletionChunk.model_validate(event)
    assert any(e["choices"] and e["choices"][0]["delta"].get("tool_calls") for e in events)


def test_the_openai_clients_parse_gets_its_tools_arguments_back(client) -> None:
    """The official client's ``parse`` with ``pydantic_function_tool`` (a strict schema of a
    pydantic model): each call's arguments parsed back into the model."""

    class GetWeather(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=6)
        unit: Literal["celsius", "fahrenheit"]

    done = client.beta.chat.completions.parse(
        model=MODEL, messages=USER, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice="required", max_tokens=120, temperature=0,
    )  # fmt: skip
    calls = done.choices[0].message.tool_calls
    assert calls, done
    for c in calls:
        assert c.function.name == "GetWeather"
        assert isinstance(c.function.parsed_arguments, GetWeather), c
        assert c.function.parsed_arguments == GetWeather.model_validate_json(c.function.arguments)


def test_a_call_cut_by_max_tokens_says_length(client) -> None:
    done = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=NAMED, max_tokens=3
    )
    choice = done.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls[0].function.arguments.startswith("{")


def test_none_answers_in_text(client) -> None:
    done = client.chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert done.choices[0].message.tool_calls is None
    assert isinstance(done.choices[0].message.content, str)


def test_earlier_calls_and_their_results_go_to_the_template(server, client) -> None:
    """A conversation that called a tool and got its answer: it is served, and /tokenize
    counts the tools and messages as chat's prompt does."""
    history = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "lights", "arguments": '{"on":true}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "done"},
    ]
    done = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice=NAMED, max_tokens=40
    )
    status, counted = call(
        server[0], "POST", "/tokenize", {"model": MODEL, "messages": history, "tools": TOOLS}
    )
    assert status == 200, counted
    assert counted["count"] == done.usage.prompt_tokens


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),  # "auto", the default with tools
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER] * 2, "tool_choice": "required"}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
            "tools[0].function.name",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": BIG, "tool_choice": "required"}, "tools"),
        (
            {"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "none"},
            "tools[0].type",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        (
            {
                "messages": [{"role": "user", "content": None}],
                "tools": TOOLS,
                "tool_choice": "none",
            },
            "messages[0].content",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [
                            {
                                "id": "1",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                ],
                "tools": TOOLS,
                "tool_choice": "none",
            },
            "messages[0].tool_calls",
        ),
        (  # a tool's answer must say which call it answers (OpenAI: a 400)
            {"messages": [*USER, {"role": "tool", "content": "done"}], "tool_choice": "none"},
            "messages[1].tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "call_1"}]},
            "messages[0].tool_call_id",
        ),
    ],
)
def test_refused_before_anything_runs(server: tuple[int, Spy], fields: dict, param: str) -> None:
    port, spy = server
    calls = spy.calls
    status, body = call(port, "POST", *chat(**fields))
    assert_bad(status, body, param)
    assert "two functions" not in body["error"]["message"] or fields["tools"] == [WEATHER] * 2
    assert spy.calls == calls


def test_a_hostile_schema_is_refused_naming_tools(server: tuple[int, Spy]) -> None:
    """A pattern whose lexer blows up compiles at the ingress and is refused when the worker
    makes its matcher, where the engine names its own field: the client hears ``tools``."""
    hostile = {
        "type": "object",
        "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
        "required": ["a"],
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": hostile}}]
    for stream in (False, True):
        status, body = call(
            server[0], "POST", *chat(tools=tools, tool_choice="required", stream=stream)
        )
        assert_bad(status, body, "tools")
        assert body["error"]["message"].startswith("tools: lexer error"), body
