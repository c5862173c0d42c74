"""Structured outputs (vLLM's, through llguidance): the text a JSON schema, a regex, a choice
or a grammar allows, in the engine (tiny-random: its tokens are bytes, so any text can be
spelled) and over HTTP (``response_format``, ``structured_outputs``, ``guided_*``); refused
with a 400 naming the field when malformed or when two are given. The real model's JSON:
test_real_model.py."""

from __future__ import annotations

import json
import math
import pickle
import re
import subprocess
import sys
from typing import Literal

import jsonschema
import pydantic
import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.workers.structured_output import StructuredOutputsParams as Spec
from tests.api_helpers import assert_bad, chat, complete
from tests.openai_helpers import MODEL, USER, Spy, call

REGEX = r"[0-9]{3}-[a-z]{2}"
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "ok"],
    "additionalProperties": False,
}
# tiny-random is random: where JSON allows whitespace it may never stop writing it, so the
# schemas it answers keep it out (llguidance's own option, which the schema may set).
COMPACT = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", block_size=4, num_kv_blocks=256, progress=False)


def run(llm: LLM, spec: Spec | dict, **kw) -> object:
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 40), structured_outputs=spec, **kw)
    return llm.generate([kw.pop("prompt", "Hello")], params)[0]


# -- the params ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        (
            {"regex": "a(b"},
            'regex: at 1(8): invalid regex "a(b" (in regex): regex parse error: unclosed group',
        ),
        ({"grammar": "root ::= missing"}, "grammar: "),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1, 2]"}, "JSON schema object"),
        ({"choice": []}, "choice must be"),
        ({"choice": ["a", ""]}, "choice must be"),
        ({"regex": "a" * 70_000}, "at most"),
        ({"json_object": False}, "exactly one"),
    ],
)
def test_a_bad_spec_is_a_value_error_naming_the_field(kw: dict, says: str) -> None:
    with pytest.raises(ValueError, match=r"^structured_outputs: ") as e:
        Spec(**kw)
    assert says in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^structured_outputs: "):
        SamplingParams(structured_outputs=kw)


def test_a_spec_keeps_its_schema_key_order_and_crosses_processes() -> None:
    spec = Spec(json={"z": 1, "type": "object", "a": 2})
    assert list(json.loads(spec.json)) == ["z", "type", "a"]  # the order JSON is written in
    params = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert params.structured_outputs == Spec(choice=("a", "b"))
    assert pickle.loads(pickle.dumps(params)) == params  # as Ray ships it to a worker
    with pytest.raises(ValueError, match=r"^structured_outputs: takes json"):
        SamplingParams(structured_outputs={"jsonn": "{}"})


# -- the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_the_text_is_what_the_constraint_allows(llm: LLM, temperature: float) -> None:
    free = run(llm, None, temperature=0, ignore_eos=True) if temperature == 0 else None
    for seed in range(3):
        kw = {"temperature": temperature, "seed": seed}
        out = run(llm, Spec(regex=REGEX), **kw)
        assert re.fullmatch(REGEX, out.text) and out.finish_reason == "stop", out.text
        out = run(llm, Spec(choice=("alpha", "beta gamma")), **kw)
        assert out.text in ("alpha", "beta gamma") and out.finish_reason == "stop"
        out = run(llm, Spec(grammar='root ::= "yes" | "no"'), **kw)
        assert out.text in ("yes", "no")
        for spec in (Spec(json=SCHEMA, disable_any_whitespace=True), Spec(json=COMPACT)):
            out = run(llm, spec, **kw)
            jsonschema.validate(json.loads(out.text), SCHEMA)
            assert not re.search(r"\s", out.text), out.text
    if free is not None:  # the constraint changed what this model says on its own
        assert not re.fullmatch(REGEX, free.text)


def test_logprobs_are_of_the_masked_logits(llm: LLM) -> None:
    """vLLM applies the grammar's mask before its sampler: a token the grammar refuses has
    logprob -inf, and the allowed ones share all the mass."""
    out = run(llm, Spec(choice=("a", "b")), temperature=0, logprobs=5)
    first = out.logprobs[0]
    finite = {t: lp for t, lp in first.items() if lp > -math.inf}
    assert set(finite) <= {ord("a"), ord("b")}, first  # tiny-random: token id = byte
    assert math.isclose(sum(math.exp(lp) for lp in finite.values()), 1.0, rel_tol=1e-4)


def test_a_resumed_request_goes_on_under_its_constraint(llm: LLM) -> None:
    spec = Spec(json=SCHEMA, disable_any_whitespace=True)
    whole = run(llm, spec, temperature=1.0, seed=7)
    head = whole.token_ids[:5]
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7, structured_outputs=spec)
    rid = llm.engine.add_request("Hello", params, resumed_token_ids=head)
    outs = llm._drain([rid])
    resumed = next(d.output for d in outs if d.output is not None)
    assert resumed.token_ids == whole.token_ids and resumed.text == whole.text
    with pytest.raises(ValueError, match=r"^resumed_token_ids: structured_outputs"):
        llm.engine.add_request("Hello", params, resumed_token_ids=[ord("x")])


def test_the_grammar_ends_a_request_other_masks_hold_open(llm: LLM) -> None:
    """min_tokens holds EOS back past the grammar's end (vLLM leaves the row undefined): the
    request stops there, without the token the grammar refused; under ignore_eos it stops at
    the grammar's EOS instead of running to max_tokens."""
    out = run(llm, Spec(regex="ab"), temperature=0, min_tokens=5)
    assert (out.text, out.finish_reason, out.stop_reason) == ("ab", "stop", None)
    assert len(out.token_ids) == 3  # "a", "b" and the refused one
    out = run(llm, Spec(regex="ab"), temperature=0, ignore_eos=True)
    assert (out.text, out.finish_reason) == ("ab", "stop")
    assert out.token_ids[-1] in llm.engine.eos_token_ids and len(out.token_ids) == 3


# -- HTTP ----------------------------------------------------------------------------------

JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "c", "schema": COMPACT}}


@pytest.mark.parametrize(
    ("make", "fields", "check"),
    [
        (chat, {"response_format": JSON_SCHEMA_FORMAT}, "schema"),
        (complete, {"response_format": JSON_SCHEMA_FORMAT}, "schema"),
        (chat, {"guided_json": COMPACT}, "schema"),
        (complete, {"guided_json": json.dumps(COMPACT)}, "schema"),
        (chat, {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "schema"),
        (chat, {"guided_regex": REGEX}, "regex"),
        (complete, {"structured_outputs": {"regex": REGEX}}, "regex"),
        (chat, {"guided_choice": ["up", "down"]}, "choice"),
        (complete, {"guided_grammar": 'root ::= "up" | "down"'}, "choice"),
        (chat, {"response_format": {"type": "text"}}, None),
    ],
)
def test_http_serves_each_field(server: tuple[int, Spy], make, fields: dict, check) -> None:
    status, body = call(server[0], "POST", *make(max_tokens=60, temperature=0.8, **fields))
    assert status == 200, body
    choice = body["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    assert choice["finish_reason"] == "stop" or check is None, body
    if check == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif check == "regex":
        assert re.fullmatch(REGEX, text), text
    elif check == "choice":
        assert text in ("up", "down"), text


def test_http_json_object_is_an_object(server: tuple[int, Spy]) -> None:
    """Any object: tiny-random may not close it within max_tokens, so only what it began."""
    status, body = call(
        server[0], "POST", *chat(max_tokens=8, response_format={"type": "json_object"})
    )
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith("{"), body


@pytest.mark.parametrize(
    ("make", "fields", "param"),
    [
        (chat, {"guided_regex": "a(b"}, "guided_regex"),
        (complete, {"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
        (chat, {"guided_json": "{oops"}, "guided_json"),
        (chat, {"response_format": {"type": "json_schema"}}, "response_format"),
        (chat, {"response_format": {"type": "structural_tag"}}, "response_format"),
        (chat, {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        (chat, {"structured_outputs": {}}, "structured_outputs"),
        (chat, {"guided_choice": []}, "guided_choice"),
        (chat, {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        (
            complete,
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
        ),
    ],
)
def test_http_refuses_a_bad_or_double_constraint(
    server: tuple[int, Spy], make, fields: dict, param: str
) -> None:
    port, spy = server
    calls = spy.calls
    assert_bad(*call(port, "POST", *make(**fields)), param)
    assert spy.calls == calls  # refused before the backend saw anything


def test_the_openai_clients_parse_gets_its_model_back(client) -> None:
    """The official client's ``parse``: a pydantic model as a strict json_schema
    response_format, the answer parsed back into the model."""

    class Answer(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(
            json_schema_extra={"x-guidance": {"whitespace_flexible": False}}
        )
        color: Literal["red", "green", "blue"]
        ok: bool

    done = client.beta.chat.completions.parse(
        model=MODEL, messages=USER, response_format=Answer, max_tokens=60, temperature=0
    )
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Answer), done
    assert parsed == Answer.model_validate_json(done.choices[0].message.content)


def test_a_hostile_constraint_is_refused_before_it_runs(llm: LLM, server) -> None:
    """A regex whose lexer blows up ("(a{1000}){1000}") hits llguidance's limits when the
    worker makes its matcher, not mid-answer on the step thread; a schema nested past what
    JSON encoding takes is a ValueError, not a RecursionError."""
    hostile = SamplingParams(structured_outputs={"regex": "(a{1000}){1000}"})
    with pytest.raises(ValueError, match=r"^structured_outputs: regex: lexer error"):
        llm.engine.add_request("Hello", hostile)
    assert not llm.engine.has_unfinished()
    deep: dict = {"type": "object"}
    for _ in range(2000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match=r"^structured_outputs: json is nested too deeply"):
        Spec(json=deep)
    status, body = call(server[0], "POST", *chat(guided_regex="(a{1000}){1000}"))
    assert_bad(status, body, "structured_outputs")


@pytest.mark.parametrize(
    "spec",
    [
        {"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}},
        {"grammar": "start: x\nx: x"},
    ],
)
def test_a_constraint_no_text_can_meet_is_refused_in_words(llm: LLM, spec: dict) -> None:
    """A grammar that matches nothing (a schema that only refers to itself) is refused when
    the matcher is made, and the message says why in words, not as llguidance's stop reason
    ("NoExtensionBias")."""
    with pytest.raises(ValueError) as e:
        llm.engine.add_request("Hello", SamplingParams(structured_outputs=spec))
    assert str(e.value) == f"structured_outputs: {next(iter(spec))}: no text can match it"
    assert not llm.engine.has_unfinished()


def test_the_engine_does_not_load_torch_compile() -> None:
    """``llguidance.torch`` runs ``torch.compile`` when imported: dynamo and inductor, 2.1 s of
    every process that imports the engine (each worker; make test took minutes longer). The
    masks use numpy instead."""
    code = "import sys, kvmesh.workers.engine; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out
