"""The Serve app on real Ray: OpenAI client over HTTP, routing, the worker calls. The Python
handle: test_serving_handle.py; P/D: test_serving_pd.py."""

from __future__ import annotations

import asyncio
import re
import time

import openai
import pytest
import ray
from ray import serve

from kvmesh import SamplingParams
from kvmesh.cluster.backend import GenerateRequest
from kvmesh.cluster.frontend import PROGRESS_INTERVAL_S, ClusterBackend
from kvmesh.cluster.liveness import engine_actor_name
from kvmesh.cluster.serve_app import APP_NAME, WORKER_DEPLOYMENT_PREFIX
from kvmesh.cluster.worker_request import WorkerRequest
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.workers.block_hash import block_hashes
from tests.openai_helpers import call
from tests.ray_fixtures import ray_session, torch_loaded  # noqa: F401
from tests.serve_helpers import (
    busy_worker,
    undeploy,
    unified_app,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("ray_session")
LONG = "The quick brown fox jumps over the lazy dog. " * 6
HOSTILE = {
    "properties": {"a": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
    "required": ["a"],
}
HOSTILE_TOOLS = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": HOSTILE}}],
    "tool_choice": "required",
}


@pytest.fixture(scope="module")
def unified():
    yield unified_app()
    undeploy()


def test_openai_chat_completions_and_stream(unified) -> None:
    _, client, config = unified
    assert [m.id for m in client.models.list().data] == [config.model_name]
    messages = [{"role": "user", "content": "Hello there"}]
    chat = client.chat.completions.create(
        model=config.model_name, messages=messages, max_tokens=12, temperature=0
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    streamed = client.chat.completions.create(
        model=config.model_name, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    comp = client.completions.create(
        model=config.model_name, prompt="Once upon", max_tokens=10, temperature=0
    )
    pieces = client.completions.create(
        model=config.model_name, prompt="Once upon", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces if c.choices) == comp.choices[0].text
    # vLLM's /tokenize through Serve's proxy counts what the completion's usage did.
    status, counted = call(config.port, "POST", "/tokenize", {"prompt": "Once upon"})
    assert status == 200 and counted["count"] == comp.usage.prompt_tokens, counted
    # Several choices through Serve: each is a request of its own on the workers, placed at
    # the same time through one handle (before own_call_id, all but one hung in Serve's
    # router: a timeout, not a hang, says so).
    client = client.with_options(timeout=60, max_retries=0)
    many = client.completions.create(
        model=config.model_name, prompt=["Once upon", "Hello"], n=2, max_tokens=10, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert [c.text for c in many.choices[:2]] == [comp.choices[0].text] * 2
    streamed = client.chat.completions.create(
        model=config.model_name, messages=messages, max_tokens=12, temperature=0, n=2, stream=True
    )
    texts = ["", ""]
    for c in streamed:
        texts[c.choices[0].index] += c.choices[0].delta.content or ""
    assert texts == [chat.choices[0].message.content] * 2


def test_round_robin_second_request_pulls(unified) -> None:
    _, client, config = unified
    outs = [
        client.completions.create(model=config.model_name, prompt=LONG, max_tokens=8, temperature=0)
        for _ in range(2)
    ]
    first, second = (o.model_extra["kvmesh"] for o in outs)
    assert outs[0].choices[0].text == outs[1].choices[0].text
    assert first["worker"] != second["worker"]
    assert second["pulled_tokens"] > 0
    assert outs[1].usage.prompt_tokens_details.cached_tokens > 0
    total = second["local_hit_tokens"] + second["pulled_tokens"] + second["computed_tokens"]
    assert total == outs[1].usage.prompt_tokens


def test_a_cache_salt_pulls_only_its_own_salts_blocks(unified) -> None:
    handle, client, config = unified
    prompt = "Salted soup and salted bread for the salted fish. " * 5

    def ask(salt: str | None) -> tuple[str, dict]:
        out = client.completions.create(
            model=config.model_name,
            prompt=prompt,
            max_tokens=6,
            temperature=0,
            extra_body={} if salt is None else {"cache_salt": salt},
        )
        return out.choices[0].text, out.model_extra["kvmesh"]

    text, _ = ask("alice")
    # Round robin: the next two take turns on the two workers, and each finds alice's
    # blocks, pulled from the peer where it did not compute them.
    again = [ask("alice")[1] for _ in range(2)]
    assert all(k["local_hit_tokens"] + k["pulled_tokens"] > 0 for k in again), again
    assert any(k["pulled_tokens"] > 0 for k in again), again
    # Another salt, or none: alice's blocks are on both workers, and none of them is theirs.
    for salt in ("bob", None):
        got, kv = ask(salt)
        assert got == text and kv["local_hit_tokens"] == kv["pulled_tokens"] == 0, (salt, kv)
    got, kv = ask("bob")  # bob's own blocks are found, on either worker
    assert got == text and kv["local_hit_tokens"] + kv["pulled_tokens"] > 0, kv
    # The handle takes the salt too.
    req = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "cache_salt": "alice"}
    kv = handle.generate.remote(req).result(timeout_s=60)["kvmesh"]
    assert kv["local_hit_tokens"] + kv["pulled_tokens"] > 0, kv


def test_structured_outputs_reach_the_engine_actors(unified) -> None:
    """A regex over HTTP, a choice through the handle's plain generate: the constraint
    travels in SamplingParams to whichever worker runs it (tiny-random: bytes for tokens)."""
    handle, client, config = unified
    chat = client.chat.completions.create(
        model=config.model_name,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=20,
        extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"},
    )
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", chat.choices[0].message.content), chat
    req = {"prompt": "Pick", "max_tokens": 20, "structured_outputs": {"choice": ["up", "down"]}}
    assert handle.generate.remote(req).result()["text"] in ("up", "down")


def test_a_fast_stream_comes_in_fewer_chunks_than_tokens(unified) -> None:
    """The app's ``stream_interval_s`` (50 ms) reaches the engine actors: tiny-random makes
    a token in a few ms, so its tokens go several to a chunk, and none is lost."""
    handle, _, _ = unified
    req = {"prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    want = handle.generate.remote(req).result()["token_ids"]
    chunks = list(handle.options(stream=True).generate.remote({**req, "stream": True}))
    assert [t for c in chunks for t in c["token_ids"]] == want
    assert len(chunks) < len(want) / 2, [len(c["token_ids"]) for c in chunks]


def test_a_stream_closed_between_chunks_aborts_its_worker(unified) -> None:
    """A client that hangs up while the ingress is handing a chunk on (not waiting for the
    next) closes the backend's stream at its ``yield``: no cancellation reaches the worker
    call there, so it must be cancelled by hand, or the worker runs to max_tokens for nobody.
    """
    handle, _, config = unified
    workers = serve.get_deployment_handle(f"{WORKER_DEPLOYMENT_PREFIX}worker", APP_NAME)
    backend = ClusterBackend(config, {"worker": workers})
    params = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)

    async def read_one_then_close() -> None:
        stream = backend.stream(GenerateRequest("closed-at-yield", params, prompt="Once"))
        await anext(stream)
        await stream.aclose()

    async def read_all() -> None:
        async for _ in backend.stream(GenerateRequest("read-through", params, prompt="Once")):
            pass

    start = time.monotonic()
    asyncio.run(read_all())
    whole_s = time.monotonic() - start  # what a worker running on for nobody would take
    asyncio.run(read_one_then_close())
    closed = time.monotonic()
    wait_for(lambda: busy_worker(handle) is None, 20, "the worker to drop it", every=0.05)
    took = time.monotonic() - closed
    assert took < min(1.0, whole_s / 2), f"aborted {took:.2f} s after; whole {whole_s:.2f} s"


def test_a_worker_files_kv_under_its_own_tokens_not_a_sent_chain(unified) -> None:
    """A ``WorkerRequest``'s chain is the router's hint only: the worker hashes the tokens it
    computed, so a wrong or forged chain files no KV under another prompt's hashes."""
    worker = serve.get_deployment_handle(f"{WORKER_DEPLOYMENT_PREFIX}worker", app_name=APP_NAME)
    info = worker.worker_info.remote().result()
    real, other = list(range(100, 140)), list(range(200, 240))
    forged = block_hashes(other, 4, info["namespace"])
    work = WorkerRequest(
        "forged-chain",
        real,
        SamplingParams(max_tokens=2, temperature=0),
        chain=forged,
        fingerprint=info["fingerprint"],
    )
    deltas = list(worker.options(stream=True).generate.remote(work))
    assert deltas[-1].output is not None
    index = get_index_actor(info["fingerprint"])
    real_hashes = block_hashes(real, 4, info["namespace"])
    held = wait_for(lambda: ray.get(index.lookup.remote(real_hashes)), 10, "the prompt's blocks")
    assert max(held.values()) == len(real) // 4
    assert not ray.get(index.lookup.remote(forged))


def test_a_short_answer_sent_whole_is_not_held_for_its_progress_interval(unified) -> None:
    """A whole answer's worker reports once per PROGRESS_INTERVAL_S, but its end goes at once
    (before: a 16-token answer took a second here, its last delta held to the interval)."""
    handle, _, _ = unified
    took = []
    for i in range(3):
        req = {"prompt": [9, 8, 7, i], "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        start = time.monotonic()
        assert len(handle.generate.remote(req).result()["token_ids"]) == 16
        took.append(time.monotonic() - start)
    assert min(took) < PROGRESS_INTERVAL_S * 0.9, took


def test_a_worker_reports_an_answer_sent_whole_once_per_interval(unified) -> None:
    """``WorkerRequest.interval_s``: the ingress asks for progress once a second for an
    answer nobody reads in pieces; the worker sends few messages, every token in them."""
    worker = serve.get_deployment_handle(f"{WORKER_DEPLOYMENT_PREFIX}worker", app_name=APP_NAME)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    work = WorkerRequest("progress", list(range(50, 60)), params, interval_s=1.0)
    start = time.monotonic()
    deltas = list(worker.options(stream=True).generate.remote(work))
    took = time.monotonic() - start
    assert deltas[-1].output is not None
    assert [t for d in deltas for t in d.token_ids] == deltas[-1].output.token_ids
    assert len(deltas[-1].output.token_ids) == 200
    # The first at once, then at most one a second, and the last: bounded by the run's time
    # (not a fixed count, which a slow host would exceed).
    assert len(deltas) <= took / work.interval_s + 2, ([len(d.token_ids) for d in deltas], took)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        # refused by the worker (llguidance's limits), named by the client's field
        ({"messages": [{"role": "user", "content": "hi"}], **HOSTILE_TOOLS}, "tools"),
    ],
)
def test_bad_input_through_the_live_app(unified, body, param) -> None:
    _, client, config = unified
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=config.model_name, **body)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param


def test_unknown_model_is_404(unified) -> None:
    _, client, _ = unified
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


def test_only_engine_actors_load_torch(unified) -> None:
    """A Serve replica (ingress or worker) is a thin proxy: it starts without torch, which
    took ~1.4 s of import at every replica's start here (a replacement's too). The engine
    actors hold torch, which shows the check sees it where it is loaded."""
    unified[0].generate.remote({"prompt": [1, 2, 3], "max_tokens": 1}).result()
    named = ray.util.list_named_actors(all_namespaces=True)
    replicas = [a for a in named if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#")]
    engines = [a for a in named if a["name"].startswith(engine_actor_name(""))]
    assert len(replicas) == 3 and len(engines) == 2, named  # 1 ingress, 2 workers
    actors = replicas + engines
    loaded = {a["name"]: torch_loaded(ray.get_actor(a["name"], a["namespace"])) for a in actors}
    assert loaded == {a["name"]: a in engines for a in actors}
