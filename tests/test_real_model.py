"""smollm2-135m in kvmesh's engine against transformers loading the same GGUF file."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvmesh import SamplingParams

pytestmark = pytest.mark.real_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three prime numbers."},
    ],
    [{"role": "user", "content": "Write one sentence about the sea."}],
]
NEW_TOKENS = 32


@torch.inference_mode()
def hf_greedy(hf, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with HF's own KV cache, EOS ignored (``generate``'s min_new_tokens
    would instead forbid EOS, which changes the tokens)."""
    out = hf(torch.tensor([ids]), use_cache=True)
    tokens, logits = [], []
    for _ in range(n):
        logits.append(out.logits[0, -1].float())
        tokens.append(int(logits[-1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


def test_chat_greedy_tokens_equal_transformers(smollm2_llm, smollm2_hf) -> None:
    hf, hf_tok = smollm2_hf
    prompts = [smollm2_llm.chat_prompt(c) for c in CHATS]
    for chat, ids in zip(CHATS, prompts, strict=True):
        text = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]

    captured: list[torch.Tensor] = []
    run = smollm2_llm.engine.runner.run

    def spy(batch, tables):  # records the logits each request's tokens were sampled from
        logits = run(batch, tables)
        captured.append((tuple(s.request.request_id for s in batch if s.samples), logits))
        return logits

    smollm2_llm.engine.runner.run = spy
    try:
        outs = smollm2_llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        )
    finally:
        del smollm2_llm.engine.runner.run

    worst = 0.0
    for ids, out in zip(prompts, outs, strict=True):
        want, ref_logits = hf_greedy(hf, ids, NEW_TOKENS)
        assert out.token_ids == want, f"{out.text!r} != {hf_tok.decode(want)!r}"
        assert out.text.strip(), "an empty answer"
        rows = [lg[rids.index(out.request_id)] for rids, lg in captured if out.request_id in rids]
        for ours, theirs in zip(rows, ref_logits, strict=True):
            worst = max(worst, (ours - theirs).abs().max().item())
    print(f"max abs logit diff vs transformers over {len(prompts)}x{NEW_TOKENS} steps: {worst:.2e}")
    assert worst < 1e-3, f"max abs logit diff {worst}"


def test_a_bad_word_is_banned_mid_text_with_a_real_tokenizer(smollm2_llm) -> None:
    # smollm2 spells "rainbow" as two tokens at the start of a text and " rainbow" as one
    # mid-text: vLLM's rule drops the spaced form (its length check), and the word comes out.
    tok = smollm2_llm.tokenizer
    assert len(tok.encode("rainbow", add_special_tokens=False)) == 2
    assert len(tok.encode(" rainbow", add_special_tokens=False)) == 1
    chat = [{"role": "user", "content": "Name three colors of the rainbow."}]
    params = SamplingParams(max_tokens=24, temperature=0)
    plain = smollm2_llm.chat([chat], params)[0].text
    assert " rainbow" in plain  # greedy: the answer names it mid-text
    banned = smollm2_llm.chat([chat], SamplingParams(max_tokens=24, temperature=0,
                                                     bad_words=["rainbow"]))[0].text  # fmt: skip
    assert "rainbow" not in banned and banned != plain


def test_json_that_a_schema_allows_with_a_real_tokenizer(smollm2_llm) -> None:
    """Structured outputs on the real model and its 49k-token vocabulary, with vLLM's
    default whitespace (flexible): greedy and sampled answers parse and fit the schema, and
    stop at the object's end."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    chat = [{"role": "user", "content": "Describe a person named Alice, aged 30, as JSON."}]
    for temperature in (0, 0.7):
        params = SamplingParams(
            max_tokens=64, temperature=temperature, seed=1, structured_outputs={"json": schema}
        )
        out = smollm2_llm.chat([chat], params)[0]
        jsonschema.validate(json.loads(out.text), schema)
        assert out.finish_reason == "stop", out.text
    free = smollm2_llm.chat([chat], SamplingParams(max_tokens=64, temperature=0))[0].text
    with pytest.raises(ValueError):  # on its own the model wraps it in prose or a code block
        json.loads(free)


def test_a_tool_call_with_a_real_tokenizer(smollm2_llm) -> None:
    """tool_choice "required" (cluster/tool_calls.py) on the real model: the answer is one
    call (parallel_tool_calls: false) that the reader splits, naming a tool, with arguments
    that fit its schema; it stops at the list's end."""
    from kvmesh.cluster.tool_calls import FunctionDefinition, ToolCalling

    city = {"type": "string", "maxLength": 20}
    parameters = {"properties": {"city": city}, "required": ["city"], "additionalProperties": False}
    weather = FunctionDefinition(name="get_weather", parameters=parameters)
    calling = ToolCalling((weather, FunctionDefinition(name="now")), parallel=False)
    params = SamplingParams(
        max_tokens=64, temperature=0, structured_outputs=calling.structured_outputs()
    )
    chat = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = smollm2_llm.chat([chat], params)[0]
    assert out.finish_reason == "stop", out.text
    (call,) = calling.calls(out.text)
    assert call.name in ("get_weather", "now"), out.text
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, {"type": "object", **parameters} if call.name != "now" else {})
    assert json.loads(out.text) == [{"name": call.name, "parameters": arguments}]
