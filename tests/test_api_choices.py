"""Several choices in one response: ``n`` on both routes and a batch of prompts on
/v1/completions, against the same requests sent one by one (LocalBackend on tiny-random,
the official ``openai`` client; the response shapes checked against the OpenAPI models)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from kvmesh.cluster.generate_body import MAX_CHOICES
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.response_models import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
)
from tests.api_helpers import COMPLETIONS, assert_bad, chat, complete, sse_events
from tests.openai_helpers import GREEDY, MODEL, USER, Spy, call, check_kvmesh, wait_until

SAMPLED = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def test_chat_n_greedy_choices_are_the_single_answer(client: openai.OpenAI) -> None:
    one = client.chat.completions.create(model=MODEL, messages=USER, **GREEDY)
    three = client.chat.completions.create(model=MODEL, messages=USER, n=3, **GREEDY)
    ChatCompletionResponse.model_validate(three.model_dump(exclude_unset=True))
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    # The prompt counts once, the output of every choice.
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 12
    check_kvmesh(three.kvmesh, three.usage)  # choice 0's
    assert [c.model_extra["kvmesh"]["worker"] for c in three.choices] == ["local-0"] * 3


def test_seeded_choices_are_seed_plus_index(client: openai.OpenAI) -> None:
    """With a seed, choice i is what a request of its own with seed + i gives (vLLM's rule):
    the choices differ, and each is reproducible."""
    both = client.chat.completions.create(model=MODEL, messages=USER, n=2, seed=7, **SAMPLED)
    texts = [c.message.content for c in both.choices]
    alone = [
        client.chat.completions.create(model=MODEL, messages=USER, seed=7 + i, **SAMPLED)
        for i in range(2)
    ]
    assert texts == [a.choices[0].message.content for a in alone]
    assert texts[0] != texts[1]
    # The seed's range wraps: the largest seed and n=2 is still a valid request.
    top = client.chat.completions.create(model=MODEL, messages=USER, n=2, seed=2**63 - 1, **SAMPLED)
    low = client.chat.completions.create(model=MODEL, messages=USER, seed=-(2**63), **SAMPLED)
    assert top.choices[1].message.content == low.choices[0].message.content


def test_a_batch_of_prompts_with_n(client: openai.OpenAI, backend: LocalBackend) -> None:
    prompts = ["Once upon a time", "The end"]
    singles = [client.completions.create(model=MODEL, prompt=p, **GREEDY) for p in prompts]
    batch = client.completions.create(model=MODEL, prompt=prompts, n=2, **GREEDY)
    CompletionResponse.model_validate(batch.model_dump(exclude_unset=True))
    # OpenAI's order: prompt by prompt, n choices each.
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    want = [s.choices[0].text for s in singles for _ in range(2)]
    assert [c.text for c in batch.choices] == want
    prompt_tokens = sum(len(backend.tokenize(p)) for p in prompts)
    assert batch.usage.prompt_tokens == prompt_tokens
    assert batch.usage.completion_tokens == 4 * 12
    # Token-id batches too.
    ids = [backend.tokenize(p) for p in prompts]
    by_ids = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert [c.text for c in by_ids.choices] == [s.choices[0].text for s in singles]


def test_streamed_choices_interleave_and_match(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=USER, n=2, seed=3, **SAMPLED)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=USER,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        **SAMPLED,
    )
    chunks = list(stream)
    for c in chunks:
        ChatCompletionChunk.model_validate(c.model_dump(exclude_unset=True))
    body, usage = chunks[:-1], chunks[-1]
    assert len({c.id for c in chunks}) == 1  # one response, whatever runs its choices
    for i in range(2):
        mine = [c.choices[0] for c in body if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"  # every choice opens with its role
        assert "".join(c.delta.content or "" for c in mine) == full.choices[i].message.content
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert usage.choices == [] and usage.usage.completion_tokens == 2 * 12
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    lasts = [c for c in body if c.choices[0].finish_reason]
    assert all(c.model_extra["kvmesh"]["worker"] == "local-0" for c in lasts)


def test_streamed_batch_logprobs_count_offsets_per_choice(server: tuple[int, Spy]) -> None:
    """Completions' text_offset counts from the start of each choice's own text, in a
    stream as in a whole response."""
    body = {**complete(prompt=["Once upon a time", "The end"], max_tokens=10)[1]}
    body |= {"temperature": 0, "ignore_eos": True, "logprobs": 2}
    status, whole = call(server[0], "POST", COMPLETIONS, body)
    assert status == 200, whole
    status, events = sse_events(server[0], COMPLETIONS, {**body, "stream": True})
    assert status == 200, events
    for event in events:
        CompletionChunk.model_validate(event)
    for choice in whole["choices"]:
        i = choice["index"]
        mine = [e["choices"][0] for e in events if e["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == choice["text"]
        offsets = [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]]
        assert offsets == choice["logprobs"]["text_offset"] and offsets[0] == 0


BAD = {
    "n 0": (chat(n=0), "n"),
    "n over the cap": (chat(n=MAX_CHOICES + 1), "n"),
    "completions n over the cap": (complete(n=MAX_CHOICES + 1), "n"),
    "prompts x n over the cap": (complete(prompt=["a"] * 9, n=MAX_CHOICES // 8), "prompt"),
    "one prompt of the batch too long": (complete(prompt=["a", "a " * 300]), "prompt"),
    "one prompt of the batch empty": (complete(prompt=[[5, 6], []]), "prompt"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_choices_are_400s_and_run_nothing(server: tuple[int, Spy], case: str) -> None:
    (path, body), param = BAD[case]
    port, spy = server
    calls = spy.calls
    status, got = call(port, "POST", path, body)
    assert_bad(status, got, param)
    assert spy.calls == calls  # refused before any choice ran


def test_the_cap_itself_is_served(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=[[5, 6]] * 2, n=MAX_CHOICES // 2, max_tokens=1, temperature=0
    )
    assert len(out.choices) == MAX_CHOICES
    assert [c.index for c in out.choices] == list(range(MAX_CHOICES))


def test_one_failing_choice_fails_the_request_and_stops_the_others(
    backend: LocalBackend,
) -> None:
    """A choice that fails answers the request with its error (no partial response), and
    the other choices stop: none runs on for an answer that will not come."""
    from kvmesh.cluster.openai_api import build_api
    from tests.openai_helpers import serve

    class FailSecond(Spy):
        async def generate(self, request: Any) -> Any:
            if request.request_id.endswith("-1"):
                raise ValueError("prompt: refused by the test")
            return await super().generate(request)

    engine = backend.worker.engine
    with serve(build_api(FailSecond(backend), model_name=MODEL)) as port:
        _, body = complete(max_tokens=200, ignore_eos=True, n=3)
        status, got = call(port, "POST", COMPLETIONS, body)
        assert_bad(status, got, "prompt")
        wait_until(lambda: not backend.worker.call(engine.request_ids), "the engine to drain", 5)
        assert json.dumps(got).count("refused by the test") == 1
