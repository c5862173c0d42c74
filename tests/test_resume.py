"""Resuming a request cut off elsewhere: a fresh engine given the prompt and the first k output
tokens must stream exactly what the unbroken run streamed after them, tokens and text."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.workers.detokenizer import REPLAY_WINDOW, Detokenizer
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.outputs import StreamDelta
from kvmesh.workers.sampler import position_seed, sample
from kvmesh.workers.worker import Worker

PROMPT = "Once upon a time"
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
TOP_P = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
TOP_K = SamplingParams(max_tokens=20, temperature=0.8, top_k=20, seed=7, ignore_eos=True)
PLAIN = SamplingParams(max_tokens=20, temperature=1.0, seed=123)  # EOS may end it early
PARAMS = {"greedy": GREEDY, "top_p": TOP_P, "top_k": TOP_K, "plain": PLAIN}


def fresh(**kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM("tiny-random", block_size=4, progress=False, **kw)


def run(
    llm: LLM, prompt: str, params: SamplingParams, resumed: list[int] | None = None
) -> list[StreamDelta]:
    """One request's deltas, to the end; ``resumed`` goes through ``add_request``."""
    deltas: list[StreamDelta] = []
    llm.engine.add_request(prompt, params, on_delta=deltas.append, resumed_token_ids=resumed or ())
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert deltas and deltas[-1].output is not None
    return deltas


def check_resume(prompt: str, params: SamplingParams, cuts: list[int] | None = None) -> None:
    """Resume at each cut k on a fresh engine and compare with the unbroken stream."""
    whole = run(fresh(), prompt, params)
    want = whole[-1].output
    assert want is not None
    tokens = want.token_ids
    assert [t for d in whole for t in d.token_ids] == tokens  # one token a delta
    n = len(tokens)
    assert n >= 3, "too short to cut"
    for k in cuts or [1, n // 2, n - 1]:
        got = run(fresh(), prompt, params, tokens[:k])
        out = got[-1].output
        assert out is not None
        assert [t for d in got for t in d.token_ids] == tokens[k:], f"cut {k}"
        # Delta by delta, the stream goes on exactly as the unbroken one did.
        assert [d.text for d in got] == [d.text for d in whole[k:]], f"cut {k}"
        assert "".join(d.text for d in whole[:k] + got) == want.text
        assert out.token_ids == tokens and out.text == want.text
        assert out.prompt_token_ids == want.prompt_token_ids
        assert (out.finish_reason, out.stop_reason) == (want.finish_reason, want.stop_reason)
        assert out.num_resumed_tokens == k
        m = out.metrics
        assert m.num_local_hit_tokens + m.num_pulled_tokens + m.num_computed_tokens == (
            len(out.prompt_token_ids) + k
        )


@pytest.mark.parametrize("name", list(PARAMS))
def test_resume_matches_the_unbroken_run(name: str) -> None:
    check_resume(PROMPT, PARAMS[name])


def test_resume_at_every_cut_of_a_sampled_run() -> None:
    check_resume("The", SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7))


def test_resume_past_the_replay_window() -> None:
    """Resumed tokens beyond the detokenizer's replay window go in one decode."""
    params = SamplingParams(max_tokens=REPLAY_WINDOW + 30, temperature=0.8, seed=3)
    check_resume("The", dataclasses.replace(params, ignore_eos=True), [REPLAY_WINDOW + 20])


@pytest.mark.parametrize("window", [1, 3, REPLAY_WINDOW])
def test_replay_leaves_the_state_of_the_stream(window: int) -> None:
    """On random bytes (dangling UTF-8 sequences, held stop-string prefixes), a replay of k
    tokens leaves what streaming them one at a time left."""
    tok = fresh().tokenizer
    gen = torch.Generator().manual_seed(1)
    ids = [int(t) for t in torch.randint(0, 256, (200,), generator=gen)]
    # Multi-byte characters, and ASCII runs that start stop strings without finishing them.
    ids[20:40] = list("héllo wörld ✓ 𝄞 abcabd".encode())
    ids[100:110] = list(b"ab ab abx ")
    stops = ("abc!", "b ac", "✓✓")
    streamed = Detokenizer(tok, stops)
    held = 0
    for k in range(1, len(ids) + 1):
        streamed.update(ids[:k])
        held += streamed._stop_prefix_len(streamed.text) > 0
        replayed = Detokenizer(tok, stops)
        replayed.replay(ids[:k], window)
        state = (replayed.text, replayed.emitted, replayed.stopped_by)
        assert state == (streamed.text, streamed.emitted, streamed.stopped_by), f"k={k}"
    assert streamed.stopped_by is None and held >= 5


def test_logprobs_cover_the_new_tokens_only() -> None:
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, logprobs=2)
    want = run(fresh(), PROMPT, params)[-1].output
    assert want is not None and want.logprobs is not None
    got = run(fresh(), PROMPT, params, want.token_ids[:3])
    out = got[-1].output
    assert out is not None and out.logprobs is not None
    assert len(out.logprobs) == 5 and [len(d.logprobs or []) for d in got] == [1] * 5
    for mine, theirs in zip(out.logprobs, want.logprobs[3:], strict=True):
        assert mine.keys() == theirs.keys()
        assert all(mine[t] == pytest.approx(theirs[t], abs=1e-4) for t in mine)


def _held_cut(llm: LLM, params: SamplingParams) -> tuple[list[int], str, int]:
    """Tokens and text of an unbroken run, and a cut k whose text ends in a plain character
    (so a stop string starting there holds it back at the cut)."""
    out = llm.generate([PROMPT], params)[0]
    tok = llm.tokenizer
    for k in range(2, len(out.token_ids) - 2):
        head = tok.decode(out.token_ids[:k], skip_special_tokens=True)
        if head and out.text.startswith(head) and head[-1].isprintable() and head[-1] != "\ufffd":
            nxt = out.text[len(head) : len(head) + 1]
            if nxt and nxt != "\ufffd" and out.text.find(head[-1] + nxt) == len(head) - 1:
                return out.token_ids, out.text, k
    raise AssertionError("no cut with a plain character before it")


@pytest.mark.parametrize("name", ["greedy", "top_p"])
def test_stop_string_held_back_across_the_cut(name: str) -> None:
    params = PARAMS[name]
    tokens, text, k = _held_cut(fresh(), params)
    at = len(fresh().tokenizer.decode(tokens[:k], skip_special_tokens=True))
    # A stop string that does come: its first character, held at the cut, is never streamed.
    hit = dataclasses.replace(params, stop=(text[at - 1 : at + 1],))
    # One that does not: the held character is released by the first resumed delta.
    miss_stop = text[at - 1] + "\u2603"
    assert miss_stop not in text
    miss = dataclasses.replace(params, stop=(miss_stop,))
    for p, finish in ((hit, "stop"), (miss, "length")):
        whole = run(fresh(), PROMPT, p)
        streamed = "".join(d.text for d in whole[:k])
        assert len(streamed) < at, "the cut was meant to hold text back"
        assert whole[-1].finish_reason == finish
        check_resume(PROMPT, p, [1, k])


def test_seeded_randomness_is_batch_invariant() -> None:
    """A seeded request draws the same tokens alone, or in a batch of other requests that
    started earlier or later (so their positions differ from its own)."""
    alone = run(fresh(), PROMPT, TOP_P)[-1].output
    assert alone is not None
    llm = fresh()
    outs: dict[str, list[int]] = {}

    def keep(d: StreamDelta) -> None:
        if d.output is not None:
            outs[d.request_id] = d.output.token_ids

    eng = llm.engine
    eng.add_request("a b c d e f", TOP_K, request_id="early", on_delta=keep)
    eng.add_request("zz", SamplingParams(max_tokens=30, temperature=1.0), on_delta=keep)
    for _ in range(3):
        eng.step()
    eng.add_request(PROMPT, TOP_P, request_id="me", on_delta=keep)
    eng.add_request(PROMPT, GREEDY, request_id="greedy", on_delta=keep)
    eng.step()
    eng.add_request("late", TOP_P, request_id="late", on_delta=keep)
    while eng.has_unfinished():
        eng.step()
    assert outs["me"] == alone.token_ids
    assert outs["late"] != alone.token_ids  # same seed, other prompt: other tokens


def test_the_draw_depends_on_seed_and_position_only() -> None:
    # Pinned: workers of different versions must draw alike, or a migration changes tokens.
    assert position_seed(7, 0) == 5256147468406277708
    assert position_seed(-3, 5) == 4429160935406335180
    assert len({position_seed(s, i) for s in (0, 1, -1, 2**70) for i in range(50)}) == 200
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=gen)
    p = SamplingParams(temperature=0.9, top_p=0.95)
    g = SamplingParams(temperature=0)
    batch = sample(logits, [g, p, p, p], [0, 7, 7, 8], [0, 5, 6, 5])
    assert sample(logits[1:2], [p], [7], [5]) == batch[1:2]
    assert sample(logits[2:3], [p], [7], [6]) == batch[2:3]
    assert sample(logits[3:4], [p], [8], [5]) == batch[3:4]
    # One row at 32 positions in one batch: each draw as if alone, and they vary.
    rows = sample(logits[1:2].expand(32, 50), [p] * 32, [7] * 32, list(range(32)))
    assert rows == [sample(logits[1:2], [p], [7], [i])[0] for i in range(32)]
    assert len(set(rows)) > 1


def test_resumed_blocks_hit_the_prefix_cache() -> None:
    llm = fresh()
    want = run(llm, PROMPT, GREEDY)[-1].output
    assert want is not None
    k = 12  # prompt 16 + 12 resumed: the unbroken run cached all 7 blocks of 4 (one recomputed)
    got = run(llm, PROMPT, GREEDY, want.token_ids[:k])[-1].output
    assert got is not None and got.token_ids == want.token_ids
    assert len(want.prompt_token_ids) == 16
    assert got.metrics.num_local_hit_tokens == 24


def test_worker_passes_resumed_tokens_through() -> None:
    config = EngineConfig(model="tiny-random", block_size=4, num_kv_blocks=64, progress=False)
    worker = Worker("w", config)
    try:
        want = worker.generate(PROMPT, TOP_K)
        deltas = list(worker.stream(PROMPT, TOP_K, resumed_token_ids=want.token_ids[:5]))
        assert [t for d in deltas for t in d.token_ids] == want.token_ids[5:]
        out = worker.generate(PROMPT, TOP_K, resumed_token_ids=want.token_ids[:5])
        assert out.token_ids == want.token_ids and out.text == want.text
    finally:
        worker.shutdown()


@pytest.mark.parametrize(
    ("resumed", "params", "why"),
    [
        ([1, 2, 999], GREEDY, "integers in"),
        ([1, True], GREEDY, "integers in"),
        ([1] * 20, GREEDY, "nothing to generate"),
        ([1, 258, 2], SamplingParams(max_tokens=8, temperature=0), "EOS"),
        ([1, 9, 2], SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[9]), "stop"),
        (list(b"xyz"), SamplingParams(max_tokens=8, temperature=0, stop=["y"]), "'y'"),
    ],
)
def test_bad_resumed_tokens_name_the_field(resumed: list, params: SamplingParams, why: str) -> None:
    llm = fresh()
    with pytest.raises(ValueError, match=rf"resumed_token_ids: .*{why}"):
        llm.engine.add_request(PROMPT, params, resumed_token_ids=resumed)
    assert not llm.engine.has_unfinished()


def test_resumed_tokens_must_leave_room_in_the_context() -> None:
    llm = fresh(max_model_len=24)  # the prompt is 16 tokens
    with pytest.raises(ValueError, match=r"resumed_token_ids: .*context"):
        llm.engine.add_request(PROMPT, SamplingParams(max_tokens=20), resumed_token_ids=[1] * 8)
    assert not llm.engine.has_unfinished()
    llm.engine.add_request(PROMPT, SamplingParams(max_tokens=8), resumed_token_ids=[1] * 7)
