"""OpenAI logprobs over HTTP (chat and completions, streamed and not) against the engine's
own values, through the official client."""

from __future__ import annotations

import openai
import pytest

from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.response_shape import MIN_LOGPROB
from kvmesh.workers.sampling_params import SamplingParams
from tests.api_helpers import CHAT, COMPLETIONS, sse_events
from tests.openai_helpers import GREEDY, MODEL, USER, Spy


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


def test_echo_puts_the_prompt_first(client: openai.OpenAI, backend: LocalBackend) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon", echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL, prompt="Once upon", **GREEDY)
    assert out.choices[0].text == "Once upon" + plain.choices[0].text
    assert out.choices[0].logprobs is None
    ids = backend.tokenize("Once upon a time")
    out = client.completions.create(model=MODEL, prompt=ids, echo=True, **GREEDY)
    assert out.choices[0].text.startswith(backend.decode(ids))  # token ids echo as text


def test_echo_logprobs_score_a_continuation_as_lm_eval_does(
    client: openai.OpenAI, backend: LocalBackend, tiny_hf
) -> None:
    """lm-evaluation-harness's loglikelihood: token ids of context + continuation, echo,
    logprobs 1, max_tokens 1; it sums token_logprobs over the continuation and checks each
    token is the top one. Each prompt token's logprob is the reference model's, its first
    token's is null, and the prompt is computed although it is cached."""
    import torch

    ctx = backend.tokenize("The quick brown fox")
    cont = backend.tokenize(" jumps over the lazy dog")
    ids = ctx + cont
    client.completions.create(model=MODEL, prompt=ids, max_tokens=1)  # now cached
    out = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    with torch.inference_mode():
        ref = tiny_hf.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        best = ref[p - 1].argmax().item()
        assert max(lp.top_logprobs[p].values()) == pytest.approx(ref[p - 1, best].item(), abs=1e-4)
    assert lp.tokens[: len(ids)] == backend.token_texts(ids)
    prompt_text = backend.decode(ids)
    assert lp.text_offset[len(ids)] == len(prompt_text)  # the completion's first token
    assert lp.text_offset == sorted(lp.text_offset)
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_echo_equals_the_whole(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": ["Once upon", "A b"], "echo": True, "logprobs": 2, "n": 2}
    kw |= GREEDY
    whole = client.completions.create(**kw).choices
    streamed: dict[int, list] = {}
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            streamed.setdefault(ch.index, []).append(ch)
    assert sorted(streamed) == [0, 1, 2, 3]
    for choice in whole:
        pieces = streamed[choice.index]
        assert "".join(p.text for p in pieces) == choice.text
        assert choice.text.startswith(["Once upon", "A b"][choice.index // 2])
        lps = [p.logprobs for p in pieces if p.logprobs is not None]
        assert [t for p in lps for t in p.tokens] == choice.logprobs.tokens
        # The two runs batch the four choices as their arrivals fall: tiny-random's float32
        # matmuls round a row's last bits by its batch (smollm2's quantized ones do not).
        got, want = [t for p in lps for t in p.token_logprobs], choice.logprobs.token_logprobs
        assert [t is None for t in got] == [t is None for t in want]  # the first prompt token
        assert [t for t in got if t is not None] == pytest.approx(
            [t for t in want if t is not None], rel=1e-5
        )
        assert [o for p in lps for o in p.text_offset] == choice.logprobs.text_offset


def test_echo_with_max_tokens_0_scores_the_prompt_alone(client: openai.OpenAI) -> None:
    """vLLM's way to score a text: the prompt and its logprobs, nothing generated or counted,
    whole and streamed alike. max_tokens 0 without echo stays a 400."""
    kw = {"model": MODEL, "prompt": "Once upon a time", "echo": True, "logprobs": 1}
    out = client.completions.create(max_tokens=0, **kw)
    scored = client.completions.create(max_tokens=3, temperature=0, **kw).choices[0].logprobs
    choice = out.choices[0]
    assert choice.text == "Once upon a time" and choice.finish_reason == "length"
    n = out.usage.prompt_tokens
    assert out.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == n
    assert choice.logprobs.token_logprobs == scored.token_logprobs[:n]
    chunks = [c for c in client.completions.create(max_tokens=0, stream=True, **kw) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == choice.logprobs.tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Once upon", max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.body["message"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_logprobs_of_tokens_a_grammar_masks_are_finite(server: tuple[int, Spy], path: str) -> None:
    """A grammar that leaves one token allowed makes the others' logprobs -inf, which JSON
    cannot say: they are shown as -9999.0, as vLLM shows them, streamed or not."""
    body = {"model": MODEL, "max_tokens": 4, "structured_outputs": {"choice": ["a"]}}
    if path == CHAT:
        body |= {"messages": USER, "logprobs": True, "top_logprobs": 5}
    else:
        body |= {"prompt": "Once upon", "logprobs": 5}
    for stream in (False, True):
        status, events = sse_events(server[0], path, body | {"stream": stream})
        assert status == 200, events
        logprobs = [
            c["logprobs"] for e in events for c in e.get("choices", []) if c.get("logprobs")
        ]
        if path == CHAT:
            shown = [
                v
                for lp in logprobs
                for item in lp["content"]
                for v in [item["logprob"], *(t["logprob"] for t in item["top_logprobs"])]
            ]
        else:
            shown = [
                v
                for lp in logprobs
                for v in [
                    *lp["token_logprobs"],
                    *(x for t in lp["top_logprobs"] for x in t.values()),
                ]
            ]
        assert MIN_LOGPROB in shown  # the masked tokens are there, floored
        assert all(MIN_LOGPROB <= v <= 0 for v in shown), shown
