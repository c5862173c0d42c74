"""logit_bias, min_tokens and the presence, frequency and repetition penalties
(workers/penalties.py): the formulas against transformers' own repetition processor and
against their definitions, the engine's greedy tokens against HF transformers choosing from
the same penalized logits, and min_tokens' hold on stop strings (workers/detokenizer.py)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from kvmesh import LLM, SamplingParams
from kvmesh.workers.detokenizer import Detokenizer
from kvmesh.workers.penalties import penalize
from tests.api_helpers import assert_bad, chat, complete
from tests.conftest import HFReference
from tests.openai_helpers import MODEL, USER, Spy, call
from tests.test_resume import check_resume

VOCAB = 300


def hf_penalized(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """The logits a request chooses from, written from the definitions (transformers'
    processor for the repetition penalty)."""
    x = logits.clone()
    if len(output) < params.min_tokens:  # (these tests set ignore_eos: stop tokens only)
        x[list(params.stop_token_ids)] = float("-inf")
    for token, bias in params.logit_bias:
        x[token] += bias
    if params.repetition_penalty != 1.0:
        seen = torch.tensor([prompt + output])
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(seen, x[None])[0]
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token)
    for token in set(output):
        x[token] -= params.presence_penalty
    return x


CASES = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.5),
    SamplingParams(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2),
    SamplingParams(logit_bias={7: 100, 8: -100, 9: 0.5}, frequency_penalty=0.3),
]


@pytest.mark.parametrize("params", CASES, ids=range(len(CASES)))
def test_penalties_follow_their_definitions(params: SamplingParams) -> None:
    rng = random.Random(0)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 4
    prompts = [[rng.randrange(VOCAB) for _ in range(20)] for _ in range(3)]
    outputs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (0, 5, 40)]
    plain = SamplingParams()
    # The middle row has no penalty: its logits stay as they were.
    got = penalize(logits, [params, plain, params], prompts, outputs)
    assert not torch.equal(got[2], logits[2])
    for r, p in enumerate([params, plain, params]):
        want = hf_penalized(logits[r], p, prompts[r], outputs[r])
        assert torch.allclose(got[r], want, atol=1e-5, rtol=0), r
    assert torch.equal(got[1], logits[1])
    # The raw logits (logprobs come from them) are untouched; no penalty at all, no copy.
    assert penalize(logits, [plain] * 3, prompts, outputs) is logits


def test_repetition_penalty_is_exactly_transformers() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    seen = [3, 5, 5, 200, 17]
    got = penalize(logits, [SamplingParams(repetition_penalty=1.7)], [seen[:2]], [seen[2:]])
    want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seen]), logits.clone())
    assert torch.equal(got, want)


def test_min_tokens_bans_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    p = SamplingParams(min_tokens=3, stop_token_ids=[4, VOCAB + 5])  # an id past V is skipped

    def banned(params: SamplingParams, output: list[int]) -> list[int]:
        out = penalize(logits, [params], [[1]], [output], eos_token_ids={7})
        return torch.isinf(out[0]).nonzero().squeeze(1).tolist()

    assert banned(p, [1, 2]) == [4, 7]
    assert banned(p, [1, 2, 3]) == []
    assert banned(SamplingParams(min_tokens=3, stop_token_ids=[4], ignore_eos=True), []) == [4]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", block_size=4, num_kv_blocks=96, progress=False)


def hf_greedy_penalized(hf: HFReference, prompt: list[int], params: SamplingParams) -> list[int]:
    out: list[int] = []
    for _ in range(params.max_tokens):
        logits = hf_penalized(hf.logits(prompt + out), params, prompt, out)
        out.append(int(logits.argmax()))
    return out


def test_greedy_tokens_equal_transformers_choosing_from_the_same_logits(
    llm: LLM, tiny_hf: HFReference
) -> None:
    # Greedy on tiny-random repeats tokens for prompts 1, 2 and 3 (the penalties change
    # those); a batch mixes penalized requests with a plain one, which stays plain greedy.
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(3, 30))] for _ in range(4)]
    base = dict(max_tokens=16, temperature=0, ignore_eos=True)
    batch = [
        (prompts[2], SamplingParams(**base, presence_penalty=2.0)),
        (prompts[1], SamplingParams(**base, frequency_penalty=1.0)),
        (prompts[3], SamplingParams(**base, repetition_penalty=1.5)),
        (prompts[0], SamplingParams(**base, logit_bias={10: 5.0}, presence_penalty=0.5)),
        (prompts[2], SamplingParams(**base)),
    ]
    outs = llm.generate([p for p, _ in batch], [c for _, c in batch])
    assert outs[-1].token_ids == tiny_hf.greedy(prompts[2], 16)[0]
    for (prompt, params), out in zip(batch[:-1], outs, strict=False):
        assert out.token_ids == hf_greedy_penalized(tiny_hf, prompt, params), params
        assert out.token_ids != tiny_hf.greedy(prompt, 16)[0], "the penalty changed nothing"


def test_logit_bias_forces_and_bans_tokens_when_sampling(llm: LLM) -> None:
    forced = SamplingParams(max_tokens=8, temperature=1.0, seed=1, logit_bias={42: 100})
    assert llm.generate([[1, 2, 3]], forced)[0].token_ids == [42] * 8
    free = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate([[1, 2, 3]], free)[0].token_ids[0]
    banned = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logit_bias={first: -100})
    assert first not in llm.generate([[1, 2, 3]], banned)[0].token_ids


def test_a_resumed_request_is_penalized_for_its_resumed_tokens(llm: LLM) -> None:
    # A request moved to another worker carries what it said: the penalties count it, so the
    # rest is what the unbroken run would have said.
    prompt = [5, 6, 7, 8]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, presence_penalty=2.0)
    whole = llm.generate([prompt], params)[0].token_ids
    engine = llm.engine
    rid = engine.add_request(prompt, params, resumed_token_ids=whole[:5])
    rest: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == rid:
                rest += delta.token_ids
    assert whole[:5] + rest == whole


def test_min_tokens_holds_off_stop_tokens(llm: LLM, tiny_hf: HFReference) -> None:
    prompt = [5, 6, 7, 8, 9]
    stop = tiny_hf.greedy(prompt, 1)[0][0]  # the greedy answer's first token stops it at once
    base = dict(max_tokens=12, temperature=0, stop_token_ids=[stop], ignore_eos=True)
    assert llm.generate([prompt], SamplingParams(**base))[0].token_ids == [stop]
    params = SamplingParams(**base, min_tokens=4)
    out = llm.generate([prompt], params)[0]
    want = hf_greedy_penalized(tiny_hf, prompt, params)
    if stop in want[4:]:
        want = want[: want.index(stop, 4) + 1]
    assert out.token_ids == want and len(want) >= 4 and stop not in want[:4]


class Chars:
    """A tokenizer whose token i is the character chr(i)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def stream_text(
    text: str, stop: tuple[str, ...], min_tokens: int, include: bool = False
) -> tuple[str, int, str | None]:
    """(what a stream of ``text``'s characters as tokens releases, tokens taken, stop)."""
    d, ids, pieces = Detokenizer(Chars(), stop, min_tokens, include), [ord(c) for c in text], []
    for k in range(1, len(ids) + 1):
        pieces.append(d.update(ids[:k], final=k == len(ids)))
        if d.stopped_by is not None:
            pieces.append(d.update(ids[:k], final=True))
            break
    assert "".join(pieces) == d.text
    return d.text, k, d.stopped_by


def test_no_stop_string_counts_before_min_tokens() -> None:
    text = "abSTOPcSTOPd"
    assert stream_text(text, ("STOP",), 0) == ("ab", 6, "STOP")
    assert stream_text(text, ("STOP",), 6) == ("ab", 6, "STOP")  # completed by token 6
    assert stream_text(text, ("STOP",), 7) == ("abSTOPc", 11, "STOP")  # the first never counts
    assert stream_text(text, ("STOP",), 12) == (text, 12, None)
    # A resumed request's detokenizer replays to the state streaming left, min_tokens included.
    ids = [ord(c) for c in text]
    for k in range(1, len(ids) + 1):
        streamed, replayed = Detokenizer(Chars(), ("STOP",), 7), Detokenizer(Chars(), ("STOP",), 7)
        for n in range(1, k + 1):
            streamed.update(ids[:n])
        replayed.replay(ids[:k], window=3)
        state = (replayed.text, replayed.emitted, replayed.stopped_by)
        assert state == (streamed.text, streamed.emitted, streamed.stopped_by), k


def test_a_stop_string_is_kept_when_asked() -> None:
    """vLLM's include_stop_str_in_output: the text ends with the stop string, streamed too
    (the held-back start of it is released with the rest)."""
    text = "abSTOPcSTOPd"
    assert stream_text(text, ("STOP",), 0, include=True) == ("abSTOP", 6, "STOP")
    assert stream_text(text, ("STOP",), 7, include=True) == ("abSTOPcSTOP", 11, "STOP")
    assert stream_text("xxABCDyy", ("BCD", "ABC"), 0, include=True) == ("xxABC", 5, "ABC")


def test_a_resumed_request_keeps_min_tokens_and_penalties() -> None:
    # Cut at 1, n / 2 and n - 1 tokens: the rest streams as the unbroken run did, text too.
    params = SamplingParams(
        max_tokens=14, temperature=0.8, seed=7, min_tokens=6, stop=["e", "a", " "],
        presence_penalty=1.0, ignore_eos=True,
    )  # fmt: skip
    check_resume("The", params)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("inf")), "frequency_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(repetition_penalty=True), "repetition_penalty"),
        (dict(logit_bias={1: 101}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias=[(1, 1), (1, 2)]), "logit_bias"),
        (dict(logit_bias="x"), "logit_bias"),
        (dict(min_tokens=17), "min_tokens"),  # above max_tokens (16)
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=1.5), "min_tokens"),
    ],
)
def test_bad_values_are_named(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kw)


def test_a_token_outside_the_vocabulary_is_named(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=r"^logit_bias: token ids must be in the vocabulary"):
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert not llm.engine.has_unfinished()


# -- over HTTP (uvicorn over a LocalBackend on tiny-random: conftest.py's ``server``) ----------


def test_the_api_applies_logit_bias_and_penalties(server: tuple[int, Spy], client) -> None:
    port, spy = server
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=4, logit_bias={"42": 100}, temperature=0
    )
    assert reply.choices[0].message.content == spy.decode([42] * 4)
    reply = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, logit_bias={"42": 100}, presence_penalty=-2,
        frequency_penalty=0.5, extra_body={"repetition_penalty": 1.1},
    )  # fmt: skip
    assert reply.choices[0].text == spy.decode([42] * 4)
    # the params that reached the backend
    path, body = complete(max_tokens=1, presence_penalty=1.5, frequency_penalty=-1,
                          repetition_penalty=1.25, logit_bias={"7": -3, "9": 2.5},
                          min_p=0.05, min_tokens=1)  # fmt: skip
    status, _ = call(port, "POST", path, body)
    assert status == 200
    params = spy.last.params
    assert (params.presence_penalty, params.frequency_penalty) == (1.5, -1)
    assert params.repetition_penalty == 1.25
    assert dict(params.logit_bias) == {7: -3, 9: 2.5}
    assert params.min_p == 0.05  # vLLM's min_p (test_sampler.py: what it does)
    assert params.min_tokens == 1
    # Over completions' default max_tokens (16), where chat's default fills the context.
    assert_bad(*call(port, "POST", *complete(min_tokens=20)), "min_tokens")
    assert call(port, "POST", *chat(min_tokens=20))[0] == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -100}, "frequency_penalty"),
        ({"frequency_penalty": "0"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"min_tokens": 10**6}, "min_tokens"),  # over the default max_tokens
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_p": -0.1}, "min_p"),
        ({"logit_bias": [1]}, "logit_bias"),
        ({"logit_bias": {"50": "x"}}, "logit_bias"),
        ({"logit_bias": {"50": 101}}, "logit_bias"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"-1": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 1, "01": 2}}, "logit_bias"),
        ({"logit_bias": {"99999999999999999999": 1}}, "logit_bias"),
        ({"logit_bias": {str(1 << 20): 1}}, "logit_bias"),  # past tiny-random's vocabulary
    ],
    ids=lambda x: str(x),
)
@pytest.mark.parametrize("make", [chat, complete], ids=["chat", "completions"])
def test_a_bad_penalty_or_bias_is_a_400(
    server: tuple[int, Spy], make: Any, fields: dict, param: str
) -> None:
    port, spy = server
    calls = spy.calls
    assert_bad(*call(port, "POST", *make(**fields)), param)
    assert spy.calls == calls  # refused before the backend saw anything


def test_openapi_declares_the_ranges(server: tuple[int, Spy]) -> None:
    status, schema = call(server[0], "GET", "/openapi.json")
    assert status == 200
    models = schema["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        fields = models[name]["properties"]
        for penalty in ("presence_penalty", "frequency_penalty"):
            assert fields[penalty]["anyOf"][0] == {"type": "number", "minimum": -2, "maximum": 2}
        rep = fields["repetition_penalty"]["anyOf"][0]
        assert rep == {"type": "number", "exclusiveMinimum": 0, "maximum": 2}
        bias = fields["logit_bias"]["anyOf"][0]
        assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
        assert bias["maxProperties"] == SamplingParams.MAX_LOGIT_BIAS
