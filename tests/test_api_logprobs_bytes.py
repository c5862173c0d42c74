"""Logprobs of tokens that hold part of a character (a byte-level BPE spells "Ü" with two
tokens, "🚀" with up to four; each token's own text shows such a part as "\\ufffd"): chat's
``bytes`` are each token's raw bytes, so joined they spell the content, and completions'
``text_offset`` says where in the text each token's part is.

Over HTTP, streamed and not: the engine on tiny-random (each byte is a token), and a backend
that replays SmolLM2's tokens of a fixed text (merged tokens such as "ĠÃ", b" \\xc3").
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import openai
import pytest

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest, KvSource
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from kvmesh.workers import chat
from kvmesh.workers.detokenizer import Detokenizer
from kvmesh.workers.sampling_params import SamplingParams
from kvmesh.workers.tokenizer_loader import load_tokenizer
from tests.openai_helpers import MODEL, serve

# tiny-random's greedy answers to these hold characters of 2 and 3 bytes (and invalid bytes).
CHAT_USER = [{"role": "user", "content": "Schreib etwas Schönes."}]
PROMPT = "Ünïcödé"
N = 24  # tokens generated
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": N, "extra_body": {"ignore_eos": True}}

# SmolLM2 spells the first " Ü" as "ĠÃ" + "ľ", "🚀" as "ĠðŁ" + "ļ" + "Ģ".
SCRIPT = " Ünïcödé Ünïcödé 🚀 日本語 ok!"
SMOLLM2 = "smollm2-135m"


def lossy(raw: bytes) -> str:
    """What a byte-level BPE's decoder makes of bytes."""
    return raw.decode("utf-8", errors="replace")


def multi_byte(text: str) -> list[str]:
    """The characters of ``text`` that take more than one byte-level token."""
    return [c for c in text if ord(c) > 127 and c != "\ufffd"]


def whole_tokens_at_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Offsets run forward within the text, and a token of whole characters is there."""
    assert len(offsets) == len(tokens)
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets), offsets
    for i, (tok, at) in enumerate(zip(tokens, offsets, strict=True)):
        if "\ufffd" not in tok:
            assert text[at:].startswith(tok), (i, tok, at, text[at : at + 8])


def completion_logprobs(
    client: openai.OpenAI, stream: bool, **kw: Any
) -> tuple[str, list[str], list[int]]:
    """(text, tokens, text_offset) of a completion, its stream chunks put together."""
    if not stream:
        choice = client.completions.create(logprobs=1, **kw).choices[0]
        return choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    text, tokens, offsets = "", [], []
    for c in client.completions.create(logprobs=1, stream=True, **kw):
        text += c.choices[0].text
        if c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            offsets += c.choices[0].logprobs.text_offset
    return text, tokens, offsets


def chat_logprobs(client: openai.OpenAI, stream: bool, **kw: Any) -> tuple[str, list[Any]]:
    """(content, logprobs.content items) of a chat completion, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(logprobs=True, **kw).choices[0]
        return choice.message.content, choice.logprobs.content
    content, items = "", []
    for c in client.chat.completions.create(logprobs=True, stream=True, **kw):
        content += c.choices[0].delta.content or ""
        if c.choices[0].logprobs is not None:
            items += c.choices[0].logprobs.content
    return content, items


# -- the engine on tiny-random -----------------------------------------------------------------


def test_chat_bytes_spell_the_content(client: openai.OpenAI) -> None:
    """Each token's ``bytes`` is its one byte (tiny-random's tokens are bytes), not the UTF-8
    of "\\ufffd": joined, they decode to the content, characters over several tokens too.
    Streamed, the same."""
    kw = {"model": MODEL, "messages": CHAT_USER, "top_logprobs": 2, **GREEDY}
    content, items = chat_logprobs(client, False, **kw)
    assert multi_byte(content) and len(items) == N
    assert lossy(b"".join(bytes(item.bytes) for item in items)) == content
    for item in items:
        for named in (item, *item.top_logprobs):
            assert len(named.bytes) <= 1 and lossy(bytes(named.bytes)) == named.token

    def named(items: list[Any]) -> list[Any]:
        return [(i.token, i.bytes, [(t.token, t.bytes) for t in i.top_logprobs]) for i in items]

    streamed_content, streamed = chat_logprobs(client, True, **kw)
    assert streamed_content == content and named(streamed) == named(items)


def test_completion_text_offsets_point_into_the_text(
    client: openai.OpenAI, backend: LocalBackend
) -> None:
    """Token i's offset is where the text stands once the tokens before it are decoded: a
    token that completes a character adds it at the offset its first byte got. Streamed (the
    offsets continue across chunks), the same."""
    kw = {"model": MODEL, "prompt": PROMPT, **GREEDY}
    text, tokens, offsets = completion_logprobs(client, False, **kw)
    assert len(multi_byte(text)) >= 2 and len(tokens) == N
    whole_tokens_at_offsets(text, tokens, offsets)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    ids = backend.worker.generate(backend.tokenize(PROMPT), params).token_ids
    assert backend.token_texts(ids) == tokens
    raw = [bytes([t]) if t < 256 else b"" for t in ids]  # tiny-random: ids 0-255 are bytes
    for i, at in enumerate(offsets):
        # The text of the bytes before the token, less a character they hold only part of
        # (the token may complete it), up to all of it.
        before = b"".join(raw[:i])
        low, high = len(lossy(before)) - _pending(before), len(lossy(before))
        assert low <= at <= high, (i, at, low, high)
    assert completion_logprobs(client, True, **kw) == (text, tokens, offsets)


def _pending(raw: bytes) -> int:
    """1 when ``raw`` ends in an incomplete UTF-8 character (shown as one "\\ufffd")."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return int(len(decoder.decode(raw)) < len(lossy(raw)))


def test_text_offsets_end_at_a_stop_string(client: openai.OpenAI) -> None:
    """The tokens of the stop string (cut from the text) are at the text's end."""
    whole = completion_logprobs(client, False, model=MODEL, prompt=PROMPT, **GREEDY)[0]
    stop = multi_byte(whole)[1]
    for stream in (False, True):
        text, tokens, offsets = completion_logprobs(
            client, stream, model=MODEL, prompt=PROMPT, stop=[stop], **GREEDY
        )
        assert text == whole[: whole.index(stop)] and offsets[-1] == len(text)
        whole_tokens_at_offsets(text, tokens, offsets)


# -- SmolLM2's tokens, replayed --------------------------------------------------------------


class Replay:
    """A backend that answers every request with SCRIPT in SmolLM2's tokens, streamed as the
    engine streams them (its Detokenizer holds back a partial character), with logprobs: the
    sampled token, then the next token of the script as an alternative."""

    model_name, max_model_len = SMOLLM2, 2048

    def __init__(self) -> None:
        self.tokenizer = load_tokenizer(SMOLLM2)
        self.vocab_size = len(self.tokenizer)
        self.ids: list[int] = self.tokenizer.encode(SCRIPT, add_special_tokens=False)

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return chat.prompt_token_ids(self.tokenizer, prompt, len(self.tokenizer))

    def tokenize_chat(self, messages: list[dict[str, str]], **template: bool) -> list[int]:
        return chat.chat_prompt_ids(self.tokenizer, messages, **template)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return chat.token_texts(self.tokenizer, ids)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        return chat.token_bytes(self.tokenizer, ids)

    def decode(self, ids: Sequence[int]) -> str:
        return chat.decode(self.tokenizer, ids)

    def _completion(self, request: GenerateRequest) -> Completion:
        n = len(self.ids)
        entries = [{t: -0.25, self.ids[(i + 1) % n]: -2.0} for i, t in enumerate(self.ids)]
        kv = KvSource("replay", 0, 0, 1, 0.0)
        return Completion(request.request_id, SCRIPT, self.ids, [0], "length", kv, entries)

    async def generate(self, request: GenerateRequest) -> Completion:
        return self._completion(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        done, detok = self._completion(request), Detokenizer(self.tokenizer)
        assert done.logprobs is not None
        for i, t in enumerate(self.ids):
            last = i == len(self.ids) - 1
            text = detok.update(self.ids[: i + 1], final=last)
            yield Chunk(
                request.request_id,
                text,
                [t],
                "length" if last else None,
                done if last else None,
                logprobs=[done.logprobs[i]],
            )

    async def stats(self) -> dict[str, Any]:
        return {}


@pytest.fixture(scope="module")
def replay() -> Iterator[tuple[openai.OpenAI, Replay]]:
    backend = Replay()
    with serve(build_api(backend, model_name=SMOLLM2)) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        yield client, backend


def _gpt2_bytes(tokenizer: Any, ids: list[int]) -> list[bytes]:
    """Each token's bytes by GPT-2's table, from transformers (independent of kvmesh)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return [bytes(byte_of[c] for c in piece) for piece in tokenizer.convert_ids_to_tokens(ids)]


@pytest.mark.parametrize("stream", [False, True])
def test_smollm2_chat_bytes_are_the_content_utf8(
    replay: tuple[openai.OpenAI, Replay], stream: bool
) -> None:
    client, backend = replay
    kw = {"model": SMOLLM2, "messages": CHAT_USER, "top_logprobs": 2}
    content, items = chat_logprobs(client, stream, **kw)
    assert content == SCRIPT and len(items) == len(backend.ids)
    assert b"".join(bytes(item.bytes) for item in items) == SCRIPT.encode()
    want = _gpt2_bytes(backend.tokenizer, backend.ids)
    assert [bytes(item.bytes) for item in items] == want
    assert want[0] == b" \xc3" and items[0].token == " \ufffd"  # the text shows a part as it is
    for i, item in enumerate(items):
        assert lossy(bytes(item.bytes)) == item.token
        # The alternative is the script's next token: the same bytes as where it is sampled.
        alt = next(t for t in item.top_logprobs if t.logprob == -2.0)
        assert bytes(alt.bytes) == want[(i + 1) % len(want)]


@pytest.mark.parametrize("stream", [False, True])
def test_smollm2_text_offsets(replay: tuple[openai.OpenAI, Replay], stream: bool) -> None:
    """Each offset counts the characters whole in the bytes before the token: " Ü" spelled
    "ĠÃ" + "ľ" gives [0, 1] (the space at 0, the "Ü" that "ľ" completes at 1), then "n" at 2."""
    client, backend = replay
    text, tokens, offsets = completion_logprobs(client, stream, model=SMOLLM2, prompt="Repeat:")
    assert text == SCRIPT and tokens[:3] == [" \ufffd", "\ufffd", "n"]
    raw = _gpt2_bytes(backend.tokenizer, backend.ids)
    want = [len(b"".join(raw[:i]).decode("utf-8", errors="ignore")) for i in range(len(raw))]
    assert offsets[:3] == [0, 1, 2] and offsets == want
    whole_tokens_at_offsets(text, tokens, offsets)


# -- token_bytes on its own --------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-random", SMOLLM2])
def test_token_bytes_of_the_whole_vocabulary(model: str) -> None:
    """GPT-2's table read back for every ordinary token; special tokens b"" (their text, as
    the generated text skips them); joined, a text's tokens give its UTF-8."""
    tok = load_tokenizer(model)
    ids = list(range(len(tok)))
    special = {t for t, added in tok.added_tokens_decoder.items() if added.special}
    ordinary = [t for t in ids if t not in special]
    got = chat.token_bytes(tok, ids)
    assert [got[t] for t in ordinary] == _gpt2_bytes(tok, ordinary)
    assert all(got[t] == b"" for t in special) and special
    encoded = tok.encode(SCRIPT, add_special_tokens=False)
    assert b"".join(chat.token_bytes(tok, encoded)) == SCRIPT.encode()


@pytest.mark.parametrize("metaspace", [False, True])
def test_token_bytes_of_sentencepiece_byte_fallback(metaspace: bool) -> None:
    """A SentencePiece vocabulary with byte fallback, "▁" for a space by a Replace step
    (Llama's decoder) or a Metaspace one: "<0xC3>" is the byte, "▁n" is b" n"."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁n": 1, "a": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    space = decoders.Metaspace() if metaspace else decoders.Replace("▁", " ")
    strip = [] if metaspace else [decoders.Strip(" ", 1, 0)]
    backend.decoder = decoders.Sequence([space, decoders.ByteFallback(), decoders.Fuse(), *strip])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    ids = [1, 3 + 0xC3, 3 + 0x9C, 2]  # " n", "Ü" over two byte tokens, "a"
    assert chat.token_bytes(tok, ids) == [b" n", b"\xc3", b"\x9c", b"a"]
    assert tok.decode(ids) == "nÜa"  # the decoder drops the text's first space
