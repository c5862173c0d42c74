"""vLLM's extension fields that kvmesh serves, over HTTP through the official ``openai`` client
(LocalBackend on tiny-random, conftest.py's ``client``): ``cache_salt``, chat's
``add_generation_prompt`` / ``continue_final_message``, ``include_stop_str_in_output``,
``stop_token_ids`` and ``skip_special_tokens``. Their bad values are ``test_openai_api.py``'s
bad input; the extensions kvmesh refuses are ``test_api_unsupported_fields.py``'s;
``allowed_token_ids`` and ``bad_words`` are ``test_allowed_bad_words.py``'s."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvmesh.cluster.local_backend import LocalBackend
from tests.openai_helpers import GREEDY, MODEL, USER


def test_a_cache_salt_hits_only_its_own_salt(client: openai.OpenAI) -> None:
    # A completion: a chat's template would start it with blocks every other chat has.
    prompt = "Salt keeps the fish. " * 8

    def ask(salt: str | None) -> Any:
        extra = {"ignore_eos": True} if salt is None else {"ignore_eos": True, "cache_salt": salt}
        out = client.completions.create(
            model=MODEL, prompt=prompt, temperature=0, max_tokens=12, extra_body=extra
        )
        out.kvmesh = out.model_extra["kvmesh"]
        return out

    first, again, other, unsalted = ask("alice"), ask("alice"), ask("bob"), ask(None)
    assert first.kvmesh["local_hit_tokens"] == 0
    assert again.kvmesh["local_hit_tokens"] > 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    for out in (other, unsalted):
        assert out.kvmesh["local_hit_tokens"] == 0, out.kvmesh
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    texts = {o.choices[0].text for o in (first, again, other, unsalted)}
    assert len(texts) == 1


def test_a_chat_can_continue_its_final_message(
    client: openai.OpenAI, backend: LocalBackend
) -> None:
    def ask(messages: list, **extra: bool) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=12,
            extra_body={"ignore_eos": True, **extra},
        )  # fmt: skip

    begun = [*USER, {"role": "assistant", "content": "Here is"}]
    options = {"add_generation_prompt": False, "continue_final_message": True}
    ids = backend.tokenize_chat(begun, **options)
    # The template's text ends with the begun reply, no end of turn and no new turn after it.
    assert backend.tokenizer.decode(ids).endswith("Here is")
    assert ids != backend.tokenize_chat(begun)  # by default a new assistant turn starts
    cont = ask(begun, **options)
    same = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert cont.usage.prompt_tokens == len(ids)
    assert cont.choices[0].message.content == same.choices[0].text
    # Without the generation prompt: the messages' own template, the answer after it.
    plain = backend.tokenize_chat(USER, add_generation_prompt=False)
    out = ask(USER, add_generation_prompt=False)
    assert out.usage.prompt_tokens == len(plain) < len(backend.tokenize_chat(USER))
    with pytest.raises(openai.BadRequestError) as both:
        ask(begun, continue_final_message=True)
    assert both.value.param == "continue_final_message"


def test_a_stop_string_is_kept_when_asked(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "The", "max_tokens": 12, "temperature": 0}
    text = client.completions.create(**kw).choices[0].text
    stop = text[2:4]
    extra = {"include_stop_str_in_output": True}
    kept = client.completions.create(**kw, stop=[stop], extra_body=extra).choices[0]
    assert kept.finish_reason == "stop" and kept.text == text[: text.find(stop) + len(stop)]
    pieces = client.completions.create(**kw, stop=[stop], extra_body=extra, stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == kept.text


def test_stop_token_ids_end_the_answer(client: openai.OpenAI) -> None:
    # A bias of 100 makes token 42 every pick; as a stop token it ends the answer at once.
    forced = {"model": MODEL, "prompt": "The", "max_tokens": 8, "logit_bias": {"42": 100}}
    free = client.completions.create(**forced)
    cut = client.completions.create(**forced, extra_body={"stop_token_ids": [7, 42]})
    assert (free.usage.completion_tokens, free.choices[0].finish_reason) == (8, "length")
    assert (cut.usage.completion_tokens, cut.choices[0].finish_reason) == (1, "stop")


def test_special_tokens_show_when_asked(client: openai.OpenAI) -> None:
    # tiny-random's token 257 is <|im_start|>, a special token: left out of the text unless
    # skip_special_tokens is false; false and true are both served, streamed too.
    kw = {"model": MODEL, "prompt": "The", "max_tokens": 3, "temperature": 0}
    hidden = client.completions.create(**kw, logit_bias={"257": 100}, extra_body={
        "ignore_eos": True, "skip_special_tokens": True})  # fmt: skip
    shown = client.completions.create(**kw, logit_bias={"257": 100}, extra_body={
        "ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
    assert hidden.choices[0].text == "" and shown.choices[0].text == "<|im_start|>" * 3
    pieces = client.completions.create(**kw, logit_bias={"257": 100}, stream=True, extra_body={
        "ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
    assert "".join(c.choices[0].text for c in pieces if c.choices) == shown.choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(**kw, extra_body={"skip_special_tokens": "no"})
    assert bad.value.param == "skip_special_tokens"


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(
    client: openai.OpenAI, backend: LocalBackend
) -> None:
    text = "Truncation keeps the end of a prompt."
    ids = backend.tokenize(text)
    kw = {"model": MODEL, "max_tokens": 6, "temperature": 0}

    def ask(prompt: Any, **extra: Any) -> Any:
        return client.completions.create(prompt=prompt, **kw, extra_body=extra)

    cut = ask(text, truncate_prompt_tokens=5, echo=True)
    tail = ask(ids[-5:])
    assert cut.usage.prompt_tokens == 5 and len(ids) > 5
    assert cut.choices[0].text == backend.decode(ids[-5:]) + tail.choices[0].text  # echo kept
    whole = ask(text)
    assert ask(text, truncate_prompt_tokens=-1).choices[0].text == whole.choices[0].text
    assert ask(text, truncate_prompt_tokens=len(ids) + 9).usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        messages=USER, **kw, extra_body={"truncate_prompt_tokens": 3}
    )
    assert chat.usage.prompt_tokens == 3
    for bad in (0, -2, "5", 2.5):
        with pytest.raises(openai.BadRequestError) as refused:
            ask(text, truncate_prompt_tokens=bad)
        assert refused.value.param == "truncate_prompt_tokens", bad
