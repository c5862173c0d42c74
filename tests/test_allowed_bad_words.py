"""vLLM's ``allowed_token_ids`` and ``bad_words``: the masks against their definitions
(workers/penalties.py, workers/bad_words.py), vLLM's tokenizing rule, the bounds, the engine's
greedy and sampled tokens (tiny-random's tokens 0-255 are the bytes themselves, so "a" is
token 97), a resumed request, and the HTTP routes (uvicorn over a LocalBackend on
tiny-random: conftest.py's ``server``): served on both, bad values a 400 naming the field
before the backend sees anything, and the OpenAPI schema's types."""

from __future__ import annotations

import itertools
from typing import Any, ClassVar

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.workers.bad_words import bad_words_token_ids, banned_tokens
from kvmesh.workers.penalties import penalize
from tests.api_helpers import assert_bad, chat, complete
from tests.openai_helpers import Spy, call

A, B = ord("a"), ord("b")
PROMPT = [5, 6, 7, 8]
INF = float("-inf")


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", block_size=4, num_kv_blocks=96, progress=False)


# -- the masks, the tokenizing rule and the bounds --------------------------------------------


def test_the_masks_follow_their_definitions() -> None:
    vocab = 50
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)) * 4
    allowed = SamplingParams(allowed_token_ids=[3, 7, 9, 3], logit_bias={7: 2.5, 8: 100})
    bad = SamplingParams(bad_words_token_ids=[[4], [1, 2, 5], [9, 6]])
    params = [allowed, SamplingParams(), bad, bad]
    outputs = [[8, 8], [1, 2], [0, 1, 2], [2, 1]]
    got = penalize(logits, params, [[1]] * 4, outputs)
    want = torch.full_like(logits[0], INF)
    want[[3, 7, 9]] = logits[0, [3, 7, 9]]
    want[7] += 2.5  # the bias still applies to an allowed token, never to another
    assert torch.equal(got[0], want)
    assert torch.equal(got[1], logits[1])  # a plain row is untouched, whatever it said
    for row, banned in ((2, [4, 5]), (3, [4])):  # [1, 2, 5]'s 5: only after 1, 2
        want = logits[row].clone()
        want[banned] = INF
        assert torch.equal(got[row], want), row
    # the raw logits stay as they were (logprobs read them)
    assert torch.isfinite(logits).all()


def test_banned_tokens_need_the_words_prefix() -> None:
    seqs = ((4,), (1, 2, 5), (2, 6))
    assert banned_tokens(seqs, []) == {4}
    assert banned_tokens(seqs, [1]) == {4}
    assert banned_tokens(seqs, [2]) == {4, 6}
    assert banned_tokens(seqs, [7, 1, 2]) == {4, 5, 6}
    assert banned_tokens(seqs, [1, 2, 3]) == {4}


class Words:
    """A tokenizer of a few words, with and without a leading space."""

    IDS: ClassVar[dict[str, list[int]]] = {
        "foo": [5, 6],
        " foo": [7, 8],
        "bar": [9],
        " bar": [10, 9],
        "baz": [3],
        " baz": [3, 4],
    }
    IDS |= {"qux": [11], " qux": [11], "nil": [], " nil": [12], "rain": [13, 14], " rain": [15]}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        return self.IDS[text]


def test_bad_words_are_tokenized_with_their_spaced_variants(llm: LLM) -> None:
    # The spaced variant counts unless the plain one's ban covers it (it ends with its
    # tokens): " foo" and " baz" count, " bar" (ends with "bar") and " qux" (the same) do not.
    # Leading whitespace is stripped first.
    got = bad_words_token_ids(Words(), ["foo", "  bar", "baz", "qux", "rain"], 20)
    # " rain" is one token where "rain" is two: vLLM's length check drops it (its bug)
    assert got == ((5, 6), (7, 8), (9,), (3,), (3, 4), (11,), (13, 14), (15,))
    with pytest.raises(ValueError, match=r"^bad_words: their tokens must be in the model's"):
        bad_words_token_ids(Words(), ["foo"], 8)
    with pytest.raises(ValueError, match=r"^bad_words: 'nil' has no tokens"):
        bad_words_token_ids(Words(), ["nil"], 20)
    # tiny-random's bytes: " ab" is three tokens, so only "ab"'s own count
    vocab = llm.engine.model_config.vocab_size
    assert bad_words_token_ids(llm.tokenizer, ["ab", " c"], vocab) == ((A, B), (ord("c"),))
    with pytest.raises(ValueError, match=r"^bad_words: they make 5120 tokens"):
        bad_words_token_ids(llm.tokenizer, ["x" * 256] * 20, vocab)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
        (dict(allowed_token_ids=[True]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1.0]), "allowed_token_ids"),
        (dict(allowed_token_ids=7), "allowed_token_ids"),
        (dict(allowed_token_ids=list(range(4097))), "allowed_token_ids"),
        (dict(allowed_token_ids=[5], bad_words_token_ids=[[5]]), "allowed_token_ids"),
        (dict(bad_words=[""]), "bad_words"),
        (dict(bad_words=[" \n"]), "bad_words"),
        (dict(bad_words=[1]), "bad_words"),
        (dict(bad_words=["x" * 257]), "bad_words"),
        (dict(bad_words=["w"] * 129), "bad_words"),
        (dict(bad_words={"w": 1}), "bad_words"),
        (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
        (dict(bad_words_token_ids=[1, 2]), "bad_words_token_ids"),
        (dict(bad_words_token_ids=[[-1]]), "bad_words_token_ids"),
        (dict(bad_words_token_ids=[[1]] * 257), "bad_words_token_ids"),
        (dict(bad_words_token_ids=[[1] * 4097]), "bad_words_token_ids"),
    ],
    ids=lambda x: str(x)[:60],
)
def test_bad_values_are_named(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        SamplingParams(**kw)


def test_the_fields_are_frozen_tuples() -> None:
    p = SamplingParams(allowed_token_ids=[1, 2], bad_words="x", bad_words_token_ids=[[1, 2]])
    assert (p.allowed_token_ids, p.bad_words, p.bad_words_token_ids) == ((1, 2), ("x",), ((1, 2),))
    same = SamplingParams(allowed_token_ids=(1, 2), bad_words=["x"], bad_words_token_ids=((1, 2),))
    assert p == same and hash(p) == hash(same)
    assert SamplingParams(bad_words=None).bad_words == ()  # off, as []
    assert SamplingParams().allowed_token_ids is None and not SamplingParams().penalized


def test_a_token_outside_the_vocabulary_or_none_to_choose_is_named(llm: LLM) -> None:
    vocab = llm.engine.model_config.vocab_size
    for kw, field in (
        (dict(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
        (dict(bad_words_token_ids=[[1, vocab]]), "bad_words_token_ids"),
    ):
        with pytest.raises(ValueError, match=f"^{field}: token ids must be in the vocabulary"):
            llm.engine.add_request([1, 2], SamplingParams(**kw))
    eos = next(iter(llm.engine.eos_token_ids))
    for kw in (
        dict(allowed_token_ids=[eos]),
        dict(allowed_token_ids=[eos, 7], stop_token_ids=[7]),
        dict(allowed_token_ids=[eos, A], bad_words=["a"]),
    ):
        with pytest.raises(ValueError, match=r"^allowed_token_ids: until min_tokens"):
            llm.engine.add_request([1, 2], SamplingParams(min_tokens=2, **kw))
        llm.engine.abort(llm.engine.add_request([1, 2], SamplingParams(**kw)))  # no min_tokens
    assert not llm.engine.has_unfinished()


# -- the engine --------------------------------------------------------------------------------


def test_allowed_token_ids_hold_greedy_and_sampled_tokens(llm: LLM) -> None:
    plain = llm.generate([PROMPT], greedy())[0].token_ids
    assert not set(plain) <= {A, B}
    # In a batch with a plain request, which stays plain greedy.
    outs = llm.generate([PROMPT, PROMPT], [greedy(allowed_token_ids=[A, B]), greedy()])
    assert set(outs[0].token_ids) <= {A, B} and len(outs[0].token_ids) == 12
    assert outs[1].token_ids == plain
    allowed = list(range(A, A + 8))
    seen: set[int] = set()
    for seed, extra in enumerate([{}, {"top_k": 5}, {"top_p": 0.5}, {"min_p": 0.5}, {}]):
        params = SamplingParams(
            max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True,
            allowed_token_ids=allowed, **extra,
        )  # fmt: skip
        tokens = llm.generate([PROMPT], params)[0].token_ids
        assert set(tokens) <= set(allowed) and len(tokens) == 12, (extra, tokens)
        seen |= set(tokens)
    assert len(seen) > 2  # sampled among the allowed tokens, not pinned to one


def test_logprobs_stay_the_models_own(llm: LLM) -> None:
    """As vLLM reports them by default (and as under a logit_bias): the raw logits'."""
    first = llm.generate([PROMPT], greedy(logprobs=0))[0]
    top, top_lp = next(iter(first.logprobs[0].items()))
    assert top not in (A, B)
    out = llm.generate([PROMPT], greedy(allowed_token_ids=[A, B], logprobs=1))[0]
    entry = out.logprobs[0]
    assert set(entry) == {out.token_ids[0], top} and entry[top] == pytest.approx(top_lp)
    assert entry[out.token_ids[0]] < entry[top]


def test_a_bad_word_of_one_token_is_never_generated(llm: LLM) -> None:
    plain = llm.generate(["Hello"], greedy(max_tokens=16))[0]
    at = next(i for i, t in enumerate(plain.token_ids) if 33 <= t < 127)  # a printable byte
    word = chr(plain.token_ids[at])
    assert word in plain.text
    out = llm.generate(["Hello"], greedy(max_tokens=16, bad_words=[word]))[0]
    assert plain.token_ids[at] not in out.token_ids and word not in out.text
    assert out.token_ids[:at] == plain.token_ids[:at]  # nothing changed before it


def test_a_longer_bad_word_bans_its_last_token_after_the_others(llm: LLM) -> None:
    plain = llm.generate([PROMPT], greedy(allowed_token_ids=[A, B]))[0].token_ids
    x, y = plain[:2]
    other = A + B - y
    params = greedy(allowed_token_ids=[A, B], bad_words=[chr(x) + chr(y)])
    tokens = llm.generate([PROMPT], params)[0].token_ids
    # x is said (nothing before it), but y never follows it: the other token does.
    assert tokens[:2] == [x, other], (plain, tokens)
    assert all((u, v) != (x, y) for u, v in itertools.pairwise(tokens)), tokens
    # Resumed after x (from another worker): the resumed tokens count as said.
    engine = llm.engine
    rid = engine.add_request(PROMPT, params, resumed_token_ids=tokens[:1])
    rest: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.request_id == rid:
                rest += delta.token_ids
    assert tokens[:1] + rest == tokens


def test_the_handle_takes_both_fields() -> None:
    from kvmesh.cluster.handle_generate import parse_request

    req = parse_request({"prompt": "x", "allowed_token_ids": [A, B], "bad_words": ["ab"]})
    assert req.params.allowed_token_ids == (A, B) and req.params.bad_words == ("ab",)
    with pytest.raises(ValueError, match=r"^allowed_token_ids: "):
        parse_request({"prompt": "x", "allowed_token_ids": []})


# -- over HTTP ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [chat, complete], ids=["chat", "completions"])
def test_the_api_holds_tokens_to_allowed_token_ids(server: tuple[int, Spy], make: Any) -> None:
    port, spy = server
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 1, "n": 3}):
        status, body = call(
            port, "POST", *make(max_tokens=8, ignore_eos=True, allowed_token_ids=[A, B], **sampling)
        )
        assert status == 200, body
        for choice in body["choices"]:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert len(text) == 8 and set(text) <= {"a", "b"}, body
    assert spy.last.params.allowed_token_ids == (A, B)
    status, body = call(port, "POST", *make(max_tokens=1, allowed_token_ids=None))
    assert status == 200 and spy.last.params.allowed_token_ids is None, body


@pytest.mark.parametrize("make", [chat, complete], ids=["chat", "completions"])
def test_the_api_bans_bad_words(server: tuple[int, Spy], make: Any) -> None:
    port, spy = server
    letters = list(range(A, A + 8))  # so that the answer is text ("a" to "h")

    def text(**fields: Any) -> str:
        path, body = make(max_tokens=16, temperature=0, ignore_eos=True, **fields)
        status, body = call(port, "POST", path, {"allowed_token_ids": letters, **body})
        assert status == 200, body
        choice = body["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]

    plain = text()
    word, pair = plain[0], plain[:2]
    assert word not in text(bad_words=[word, "never said"])
    params = spy.last.params
    assert params.bad_words == (word, "never said")
    assert params.bad_words_token_ids == ((ord(word),), tuple(b"never said"))
    # A word of two tokens: its first is said, never followed by its second.
    got = text(bad_words=[pair])
    assert got[0] == pair[0] and got[1] != pair[1] and pair not in got, (plain, got)
    for off in ([], None):
        assert text(bad_words=off) == plain


BAD: list[tuple[dict[str, Any], str]] = [
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
    ({"allowed_token_ids": [1 << 20]}, "allowed_token_ids"),  # past tiny-random's vocabulary
    ({"allowed_token_ids": [1 << 40]}, "allowed_token_ids"),
    ({"allowed_token_ids": list(range(4097))}, "allowed_token_ids"),
    ({"allowed_token_ids": ["1"]}, "allowed_token_ids[0]"),
    ({"allowed_token_ids": [1.5]}, "allowed_token_ids[0]"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids[0]"),
    ({"allowed_token_ids": 1}, "allowed_token_ids"),
    ({"allowed_token_ids": [A], "bad_words": ["a"]}, "allowed_token_ids"),
    ({"bad_words": "foo"}, "bad_words"),
    ({"bad_words": [1]}, "bad_words[0]"),
    ({"bad_words": [None]}, "bad_words[0]"),
    ({"bad_words": [""]}, "bad_words"),
    ({"bad_words": ["  "]}, "bad_words"),
    ({"bad_words": ["x" * 257]}, "bad_words"),
    ({"bad_words": ["w"] * 129}, "bad_words"),
    ({"bad_words": ["x" * 256] * 20}, "bad_words"),  # 5,120 tokens: over 4,096
]


@pytest.mark.parametrize("make", [chat, complete], ids=["chat", "completions"])
def test_a_bad_value_is_a_400(server: tuple[int, Spy], make: Any) -> None:
    port, spy = server
    status, body = call(port, "POST", *make(max_tokens=1, allowed_token_ids=[A], bad_words=["x"]))
    assert status == 200, body  # served, so a bad value is a 400 for what is wrong with it
    calls = spy.calls
    for fields, param in BAD:
        status, body = call(port, "POST", *make(**fields))
        assert_bad(status, body, param)
        assert "kvmesh does not support" not in body["error"]["message"], (fields, body)
    assert spy.calls == calls  # refused before the backend saw anything


def test_openapi_declares_the_types_and_bounds(server: tuple[int, Spy]) -> None:
    status, schema = call(server[0], "GET", "/openapi.json")
    assert status == 200
    models = schema["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        fields = models[name]["properties"]
        allowed, null = fields["allowed_token_ids"]["anyOf"]
        assert null == {"type": "null"}
        assert allowed == {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": SamplingParams.MAX_TOKEN_ID},
            "minItems": 1,
            "maxItems": SamplingParams.MAX_ALLOWED_TOKEN_IDS,
        }
        words = fields["bad_words"]["anyOf"][0]
        assert words["type"] == "array" and words["maxItems"] == SamplingParams.MAX_BAD_WORDS
        assert words["items"]["type"] == "string"
        assert words["items"]["maxLength"] == SamplingParams.MAX_BAD_WORD_LEN
        for field in ("allowed_token_ids", "bad_words"):
            assert "Not supported" not in fields[field].get("description", "")
