"""The single-worker engine against HF transformers on tiny-random (greedy, exact tokens)."""

from __future__ import annotations

import random
import re

import pytest
import torch

from kvmesh import LLM, SamplingParams
from kvmesh.workers.kv_connector import InMemoryKvCacheConnector
from tests.conftest import HFReference

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_llm(**kw) -> LLM:
    kw.setdefault("num_kv_blocks", 64)
    return LLM("tiny-random", block_size=4, progress=False, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return make_llm()


def prompts(seed: int, n: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(shared)]
    return [prefix + [rng.randrange(256) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def check_against_hf(llm: LLM, hf: HFReference, batch: list[list[int]], params=GREEDY) -> None:
    outs = llm.generate(batch, params)
    for ids, out in zip(batch, outs, strict=True):
        want, _ = hf.greedy(ids, params.max_tokens)
        assert out.token_ids == want, f"prompt of {len(ids)} tokens diverged"
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == ids


def test_mixed_lengths_match_hf(llm: LLM, tiny_hf: HFReference) -> None:
    check_against_hf(llm, tiny_hf, prompts(0, 6))


def test_shared_prefixes_match_hf_and_hit(llm: LLM, tiny_hf: HFReference) -> None:
    batch = prompts(1, 5, shared=23)
    check_against_hf(llm, tiny_hf, batch)
    again = llm.generate(batch[:2], GREEDY)
    assert all(o.metrics.num_local_hit_tokens >= 20 for o in again)
    for o in again:
        m = o.metrics
        assert m.num_local_hit_tokens + m.num_pulled_tokens + m.num_computed_tokens == len(
            o.prompt_token_ids
        )


def test_chunked_prefill_matches_hf(tiny_hf: HFReference) -> None:
    llm = make_llm(max_num_batched_tokens=7)
    check_against_hf(llm, tiny_hf, prompts(2, 4))


def test_preemption_by_a_tiny_pool_matches_hf(tiny_hf: HFReference) -> None:
    llm = make_llm(num_kv_blocks=18, max_num_batched_tokens=16)
    batch = prompts(3, 5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outs = llm.generate(batch, params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the pool was meant to run out"
    for ids, out in zip(batch, outs, strict=True):
        assert out.token_ids == tiny_hf.greedy(ids, 24)[0]
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == 18


def test_final_logits_close_to_hf(llm: LLM, tiny_hf: HFReference) -> None:
    captured: list[torch.Tensor] = []
    run = llm.engine.runner.run

    def spy(batch, tables):  # records what the engine sampled from
        logits = run(batch, tables)
        captured.append(logits)
        return logits

    llm.engine.runner.run = spy  # type: ignore[method-assign]
    try:
        ids = prompts(4, 1)[0]
        out = llm.generate([ids], GREEDY)[0]
    finally:
        del llm.engine.runner.run
    _, hf_last = tiny_hf.greedy(ids, GREEDY.max_tokens)
    diff = (captured[-1][0] - hf_last).abs().max().item()
    assert diff < 1e-4, f"max abs logit diff {diff}"
    assert len(out.token_ids) == GREEDY.max_tokens


def test_prefix_hit_through_connector_after_eviction(tiny_hf: HFReference) -> None:
    llm = make_llm(
        num_kv_blocks=16,
        connector=lambda ctx: InMemoryKvCacheConnector(
            ctx.kv_cache.read_block, ctx.kv_cache.write_block
        ),
    )
    conn = llm.engine.kv.connector
    assert isinstance(conn, InMemoryKvCacheConnector)
    ids = prompts(5, 1, shared=30)[0]
    first = llm.generate([ids], GREEDY)[0]
    # Unrelated prompts push ids' blocks out of the local pool.
    llm.generate(prompts(6, 3, shared=20), SamplingParams(max_tokens=2, temperature=0))
    assert llm.engine.kv.pool.num_evictions > 0
    second = llm.generate([ids], GREEDY)[0]
    assert second.metrics.num_pulled_tokens > 0
    assert second.token_ids == first.token_ids == tiny_hf.greedy(ids, GREEDY.max_tokens)[0]


def test_seeded_sampling_is_reproducible_in_any_batch(llm: LLM) -> None:
    p = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=50, seed=7)
    alone = llm.generate(["abc"], p)[0].token_ids
    mixed = llm.generate(["xyz", "abc"], [SamplingParams(max_tokens=5, temperature=1.0), p])
    assert mixed[1].token_ids == alone
    other = llm.generate(["abc"], SamplingParams(max_tokens=10, temperature=0.9, seed=8))[0]
    assert other.token_ids != alone


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=0))[0]
    topk = llm.generate(["hello"], SamplingParams(max_tokens=8, temperature=1.5, top_k=1))[0]
    assert greedy.token_ids == topk.token_ids


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    free = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0))[0]
    text = free.text
    assert len(text) >= 4
    stop = text[2:4]
    cut = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.find(stop)]
    assert stop not in cut.text
    keep = SamplingParams(
        max_tokens=12, temperature=0, stop=[stop], include_stop_str_in_output=True
    )
    kept = llm.generate(["The"], keep)[0]
    assert kept.text == text[: text.find(stop) + len(stop)] and kept.token_ids == cut.token_ids


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    free = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0))[0]
    tok = free.token_ids[3]
    cut = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[tok]))
    assert cut[0].finish_reason == "stop" and cut[0].stop_reason == tok
    assert cut[0].token_ids == free.token_ids[: free.token_ids.index(tok) + 1]


def test_the_ending_token_is_not_text_and_special_tokens_can_be(llm: LLM) -> None:
    # vLLM's: the EOS or stop token that ends a request is left out of the text (unless
    # include_stop_str_in_output), special tokens too unless skip_special_tokens=False.
    tok = llm.tokenizer
    free = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    t = next(t for t in free[0].token_ids if t < 256 and tok.decode([t]).strip())
    cut = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                               stop_token_ids=[t]))[0]  # fmt: skip
    assert cut.token_ids[-1] == t and cut.finish_reason == "stop"
    assert cut.text == tok.decode(cut.token_ids[:-1])
    kept = llm.generate(["The"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                stop_token_ids=[t],
                                                include_stop_str_in_output=True))[0]  # fmt: skip
    assert kept.token_ids == cut.token_ids and kept.text == tok.decode(kept.token_ids)
    assert kept.text != cut.text

    im_start, eos = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert eos in llm.engine.eos_token_ids
    forced = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {im_start: 100}}
    hidden = llm.generate(["The"], SamplingParams(**forced))[0]
    shown = llm.generate(["The"], SamplingParams(**forced, skip_special_tokens=False))[0]
    assert hidden.token_ids == shown.token_ids == [im_start] * 3
    assert hidden.text == "" and shown.text == "<|im_start|>" * 3
    streamed = llm.stream(["The"], SamplingParams(**forced, skip_special_tokens=False))
    assert "".join(d.text for d in streamed) == shown.text
    ended = llm.generate(["The"], SamplingParams(max_tokens=3, temperature=0, logit_bias={eos: 100},
                                                 skip_special_tokens=False))[0]  # fmt: skip
    assert ended.token_ids == [eos] and ended.finish_reason == "stop" and ended.text == ""


def test_a_cache_salt_shares_blocks_only_with_its_own_salt(llm: LLM) -> None:
    prompt = prompts(seed=41, n=1, shared=24)[0]

    def run(salt: str | None):
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, cache_salt=salt)
        return llm.generate([prompt], params)[0]

    first = run("alice")
    again, other, unsalted = run("alice"), run("bob"), run(None)
    assert first.metrics.num_local_hit_tokens == 0
    assert again.metrics.num_local_hit_tokens >= 24  # the same salt: every full block of the prompt
    assert other.metrics.num_local_hit_tokens == 0  # another salt: alice's blocks are not its own
    assert unsalted.metrics.num_local_hit_tokens == 0
    assert run("bob").metrics.num_local_hit_tokens >= 24  # bob's own blocks are
    assert {o.text for o in (first, again, other, unsalted)} == {first.text}


def test_stream_concatenates_to_the_final_text(llm: LLM) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    deltas = list(llm.stream(["Hi", "there"], params))
    finals = {d.request_id: d.output for d in deltas if d.output}
    assert len(finals) == 2
    for rid, out in finals.items():
        mine = [d for d in deltas if d.request_id == rid]
        assert "".join(d.text for d in mine) == out.text
        assert [t for d in mine for t in d.token_ids] == out.token_ids
        assert out.metrics.ttft_s is not None and out.metrics.ttft_s > 0


def test_chat_uses_the_template(llm: LLM) -> None:
    conv = [{"role": "user", "content": "hi"}]
    ids = llm.chat_prompt(conv)
    text = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.decode(ids) == text
    out = llm.chat(conv, SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.prompt_token_ids == ids
    # vLLM's options: the last message left open, the reply goes on with it.
    begun = [*conv, {"role": "assistant", "content": "Hello"}]
    cont = llm.chat(
        begun,
        SamplingParams(max_tokens=4, temperature=0),
        add_generation_prompt=False,
        continue_final_message=True,
    )[0]
    assert llm.tokenizer.decode(cont.prompt_token_ids).endswith("assistant\nHello")
    with pytest.raises(ValueError, match="continue_final_message"):
        llm.chat(begun, continue_final_message=True)  # with add_generation_prompt's default


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ("hi", {"max_tokens": 0}, "max_tokens"),
        ("hi", {"temperature": -0.1}, "temperature"),
        ("hi", {"top_p": 0.0}, "top_p"),
        ("hi", {"top_p": 1.5}, "top_p"),
        ("hi", {"top_k": 0}, "top_k"),
        ("hi", {"cache_salt": ""}, "cache_salt"),
        ("hi", {"cache_salt": 5}, "cache_salt"),
        ("x" * 3000, {}, "prompt"),
        ("hi", {"max_tokens": 5000}, "max_tokens"),
        ([1, 2, 99999], {}, "prompt"),
    ],
)
def test_bad_input_names_the_field(llm: LLM, prompt, params, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        llm.generate([prompt], SamplingParams(**params))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize(
    ("prompts", "params", "field"),
    [
        (None, None, "prompts"),
        (5, None, "prompts"),
        (["hi"], {"max_tokens": 2}, "params"),  # a dict, not SamplingParams
        (["hi"], [None], "params"),
        ([None], None, "prompt"),  # before: TypeError, 'NoneType' object is not iterable
        ([{"text": "hi"}], None, "prompt"),
        ([3.5], None, "prompt"),
    ],
)
def test_arguments_of_the_wrong_type_name_the_argument(llm: LLM, prompts, params, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}: must be"):
        llm.generate(prompts, params)
    assert not llm.engine.has_unfinished()


def test_a_bad_prompt_in_a_batch_queues_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM("no-such-model")


@pytest.mark.parametrize(
    ("device", "said"),
    [
        ("banana", "device: 'banana' is not a device; use cpu, cuda or cuda:N"),
        ("mps", "device: kvmesh runs on cpu or cuda, got 'mps'"),
        ("cuda:7", "device: 'cuda:7', but "),
    ],
)
def test_a_device_this_process_cannot_use_is_named(device: str, said: str) -> None:
    """Before the weights load: before, torch's AssertionError ("Torch not compiled with CUDA
    enabled") from inside the model's ``.to``, or its RuntimeError listing 20 device types."""
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    with pytest.raises(ValueError, match=re.escape(said)):
        make_llm(device=device)


def test_request_that_can_never_fit_the_pool(llm: LLM) -> None:
    """A pool smaller than the model's context caps the context (as vLLM's start-up check
    would): a request beyond it is refused up front."""
    small = make_llm(num_kv_blocks=4)
    assert small.engine.max_model_len == 16  # 4 blocks of 4, not the model's 2048
    with pytest.raises(ValueError, match=r"longer than the context \(16 tokens"):
        small.generate(["x" * 20], SamplingParams(max_tokens=2))


def test_a_context_the_pool_cannot_hold_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="max_model_len: 32 tokens do not fit in the KV cache"):
        make_llm(num_kv_blocks=4, max_model_len=32)
    assert make_llm(num_kv_blocks=4, max_model_len=16).engine.max_model_len == 16
    # Past the model's own context: refused too (before, silently cut to the model's).
    model_len = make_llm(num_kv_blocks=4).engine.model_config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len: {model_len + 1} is more than the mod"):
        make_llm(num_kv_blocks=4096, max_model_len=model_len + 1)


def test_a_host_tier_larger_than_the_machine_is_refused() -> None:
    with pytest.raises(ValueError, match=r"host_cache_memory: .* more than this machine"):
        make_llm(host_cache_memory="64TiB")


@pytest.mark.parametrize(
    ("setting", "kw"),
    [
        ("host_cache_memory", {"host_cache_memory": "1KiB"}),
        ("disk_cache_size", {"disk_cache_size": "2KiB"}),  # a block file: the block and a header
    ],
)
def test_a_tier_that_holds_no_block_is_refused(setting: str, kw: dict, tmp_path) -> None:
    """tiny-random's block (4 tokens, all layers) takes 2 KiB. Before, a tier set on with less
    came up holding nothing, and every block meant for it was computed again, unsaid."""
    kw.setdefault("disk_cache_dir", str(tmp_path))
    said = rf"{setting}: '.KiB' holds no block of 4 tokens for this model \(one takes 2\.\d KiB"
    with pytest.raises(ValueError, match=said):
        make_llm(**kw)
    assert not list(tmp_path.rglob("*.kvb"))


def test_requests_arriving_together_compute_a_shared_prefix_once() -> None:
    llm = make_llm(num_kv_blocks=128, max_num_batched_tokens=512)
    shared = prompts(9, 1, shared=40)[0][:40]  # 10 full blocks of 4
    batch = [[*shared, 200 + i, 201, 202] for i in range(4)]
    outs = llm.generate(batch, GREEDY)
    cached = sorted(o.metrics.num_local_hit_tokens for o in outs)
    # One request computes the prefix; the others wait one step and hit it.
    assert cached == [0, 40, 40, 40]
    assert sum(o.metrics.num_computed_tokens for o in outs) == 40 + 4 * 3
