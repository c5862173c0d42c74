"""vLLM's ``/tokenize`` and ``/detokenize``: the counts the generation routes see (a prompt's
and a chat's usage), text back from ids, 400s naming the field, the model's 404, the API key.
Over uvicorn on a LocalBackend on tiny-random (conftest.py's ``server``)."""

from __future__ import annotations

import pytest

from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from tests.api_helpers import assert_bad, chat, complete
from tests.openai_helpers import MAX_LEN, MODEL, USER, Spy, call, serve


def test_tokenize_counts_what_generating_sees(server: tuple[int, Spy]) -> None:
    port, _ = server
    status, out = call(port, "POST", "/tokenize", {"model": MODEL, "prompt": "Hello there"})
    assert status == 200, out
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == MAX_LEN
    assert out["token_strs"] is None
    _, done = call(port, "POST", *complete(prompt="Hello there", max_tokens=1))
    assert done["usage"]["prompt_tokens"] == out["count"]
    for template in ({}, {"add_generation_prompt": False, "continue_final_message": True}):
        status, counted = call(port, "POST", "/tokenize", {"messages": USER, **template})
        assert status == 200, counted
        _, done = call(port, "POST", *chat(max_tokens=1, **template))
        assert done["usage"]["prompt_tokens"] == counted["count"], template
    plain, _ = call(port, "POST", "/tokenize", {"messages": USER, "add_generation_prompt": False})
    assert plain == 200


def test_token_strs_and_detokenize_give_the_text_back(server: tuple[int, Spy]) -> None:
    port, _ = server
    _, out = call(port, "POST", "/tokenize", {"prompt": "The quick fox", "return_token_strs": True})
    assert "".join(out["token_strs"]) == "The quick fox"
    # Unicode: a character split over tokens shows as U+FFFD in each token's own text (as
    # logprobs' token does), and whole again from /detokenize.
    text = "The quick brown fox, ünïcode too."
    _, out = call(port, "POST", "/tokenize", {"prompt": text, "return_token_strs": True})
    assert "\ufffd" in "".join(out["token_strs"])
    status, back = call(port, "POST", "/detokenize", {"model": MODEL, "tokens": out["tokens"]})
    assert status == 200 and back == {"prompt": text}
    # A chat's ids back: special tokens kept, as the template wrote them.
    _, counted = call(port, "POST", "/tokenize", {"messages": USER})
    _, back = call(port, "POST", "/detokenize", {"tokens": counted["tokens"]})
    assert USER[0]["content"] in back["prompt"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": USER}, "prompt"),
        ("/tokenize", {"prompt": ""}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": False}, "add_special_tokens"),
        ("/tokenize", {"messages": USER, "add_special_tokens": True}, "add_special_tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
        ("/detokenize", {"tokens": "12"}, "tokens"),
        ("/detokenize", {}, "tokens"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(
    server: tuple[int, Spy], path: str, body: dict, param: str
) -> None:
    assert_bad(*call(server[0], "POST", path, body), param)


def test_another_model_is_404_and_the_key_is_needed(backend: LocalBackend) -> None:
    with serve(build_api(backend, model_name=MODEL, api_key="k")) as port:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            status, out = call(port, "POST", path, body)
            assert status == 401, out
            status, out = call(
                port, "POST", path, {**body, "model": "other"}, Authorization="Bearer k"
            )
            assert status == 404 and out["error"]["code"] == "model_not_found", out
            status, out = call(port, "POST", path, body, Authorization="Bearer k")
            assert status == 200, out
