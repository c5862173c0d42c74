"""Prompt logprobs (``SamplingParams.prompt_logprobs``) in the engine against HF transformers'
log-softmax over the whole prompt, on tiny-random: chunked prefill, a prompt whose blocks are
cached (it is computed again: a hit has KV, not logits), preemption, and a batch mixing it
with plain requests."""

from __future__ import annotations

import random

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.workers import logprobs as logprobs_module
from tests.conftest import HFReference

TOL = 1e-4


def make_llm(**kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM("tiny-random", block_size=4, progress=False, **kw)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@torch.inference_mode()
def hf_prompt_logprobs(hf: HFReference, ids: list[int]) -> torch.Tensor:
    """[P - 1, V]: row p is the log-softmax predicting token p + 1."""
    return hf.model(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)


def check(entries: list[dict[int, float] | None] | None, ids: list[int], ref: torch.Tensor,
          n: int) -> None:  # fmt: skip
    assert entries is not None and len(entries) == len(ids)
    assert entries[0] is None
    for p, entry in enumerate(entries[1:]):
        tok = ids[p + 1]
        assert entry is not None and abs(entry[tok] - ref[p, tok].item()) < TOL, p
        want_top = set(ref[p].topk(n).indices.tolist()) if n else set()
        assert set(entry) == want_top | {tok}, p
        for t, lp in entry.items():
            assert abs(lp - ref[p, t].item()) < TOL


@pytest.mark.parametrize("n", [0, 3])
def test_prompt_logprobs_match_hf_in_chunks_and_after_a_hit(tiny_hf: HFReference, n: int) -> None:
    llm = make_llm(max_num_batched_tokens=7)  # a 30-token prompt takes 5 steps
    ids = prompt(1, 30)
    ref = hf_prompt_logprobs(tiny_hf, ids)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    asked = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=n)
    first = llm.generate([ids], plain)[0]
    assert first.prompt_logprobs is None
    out = llm.generate([ids], asked)[0]  # its blocks are cached now: computed again anyway
    assert out.metrics.num_local_hit_tokens == 0 and out.metrics.num_computed_tokens == 30
    assert out.token_ids == first.token_ids
    check(out.prompt_logprobs, ids, ref, n)
    again = llm.generate([ids], plain)[0]  # what it computed is cached for others
    assert again.metrics.num_local_hit_tokens == 28


def test_prompt_logprobs_in_a_mixed_batch_and_in_slices(
    tiny_hf: HFReference, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logprobs_module, "PROMPT_LOGITS_ROWS", 4)  # slices of 4 positions
    llm = make_llm()
    batch = [prompt(2, 21), prompt(3, 9), prompt(4, 1)]
    params = [
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1),
    ]
    outs = llm.generate(batch, params)
    check(outs[0].prompt_logprobs, batch[0], hf_prompt_logprobs(tiny_hf, batch[0]), 2)
    assert outs[1].prompt_logprobs is None
    assert outs[2].prompt_logprobs == [None]  # one token: nothing predicts it
    for ids, out in zip(batch, outs, strict=True):
        assert out.token_ids == tiny_hf.greedy(ids, 4)[0]


def test_prompt_logprobs_survive_preemption(tiny_hf: HFReference) -> None:
    llm = make_llm(num_kv_blocks=18, max_num_batched_tokens=16)
    batch = [prompt(10 + i, 25) for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(batch, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to run out"
    for ids, out in zip(batch, outs, strict=True):
        check(out.prompt_logprobs, ids, hf_prompt_logprobs(tiny_hf, ids), 1)


def test_the_first_streamed_delta_carries_them() -> None:
    llm = make_llm()
    ids = prompt(5, 12)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=0)
    deltas = []
    llm.engine.add_request(ids, params, on_delta=deltas.append)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert len(deltas) == 3
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == 12
    assert deltas[1].prompt_logprobs is None and deltas[2].prompt_logprobs is None
    assert deltas[2].output.prompt_logprobs == deltas[0].prompt_logprobs


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_bad_prompt_logprobs_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)  # type: ignore[arg-type]
