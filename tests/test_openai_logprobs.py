"""OpenAI logprobs over HTTP (chat and completions, streamed and not) against the engine's
own values, through the official client."""

from __future__ import annotations

import openai
import pytest

from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.workers.sampling_params import SamplingParams
from tests.openai_helpers import GREEDY, MODEL, USER


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
        assert bytes(item.bytes) == backend.token_bytes([tok])[0]  # raw, not the text's
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
