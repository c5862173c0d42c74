"""The cluster heals: worker replicas killed mid-request, the index killed under load.

Real Ray Serve and the tiny-random model. A killed replica's requests resume on another
replica with exactly the tokens of an unbroken run (greedy and seeded sampling); Serve starts
a replacement, which registers with the index and serves; the index's loss costs no request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import signal
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import ray

from kvmesh.connector.index_actor import get_index_actor
from tests.ray_fixtures import actor_pid, ray_session  # noqa: F401
from tests.serve_helpers import (
    busy_worker,
    kill_worker,
    process_alive,
    redeploy,
    replica_actor,
    running_replicas,
    served_fingerprint,
    tiny_config,
    undeploy,
    wait_for,
)

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]
T = TypeVar("T")
PROMPT = list(range(7, 90))
LONG = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 7}


@pytest.fixture(scope="module")
def served():
    # 1.5 CPUs a worker, of the session's 4: a replacement fits only once the replica it
    # replaces gave its CPUs back, as on a node sized for its workers.
    config = tiny_config(
        workers=2, router="round_robin", health_check_period_s=0.5, num_cpus_per_worker=1.5
    )
    handle = redeploy(config)
    info = handle.stats.remote().result()
    assert len(info["workers"]) == 2
    yield handle, config
    undeploy()


@pytest.fixture
def app(served):
    return served[0]


def _stream(handle, body: dict, after_tokens: int, act: Callable[[], T]) -> tuple[list[dict], T]:
    """Stream ``body``; once ``after_tokens`` tokens came, call ``act`` once. The chunks and
    what ``act`` returned. Counted in tokens, not chunks: a chunk carries every token made
    within the stream's interval, so a fast host sends 400 tokens in a few chunks (a count
    of chunks was never reached there)."""
    chunks, seen, acted = [], 0, None
    for chunk in handle.options(stream=True).generate.remote({**body, "stream": True}):
        chunks.append(chunk)
        seen += len(chunk["token_ids"])
        if acted is None and seen >= after_tokens:
            acted = (act(),)
    assert acted is not None, f"the stream ended before {after_tokens} tokens"
    return chunks, acted[0]


def _kill_busy(handle) -> str:
    """Kill the worker that runs a request; its name."""
    killed = wait_for(lambda: busy_worker(handle), 10, "the busy worker")
    kill_worker(killed)
    return killed


def _healed(handle, n: int = 2) -> None:
    wait_for(lambda: running_replicas() == n, 60, f"{n} running worker replicas", every=0.5)
    wait_for(lambda: len(handle.stats.remote().result()["workers"]) == n, 30, "registration")
    # Healed means traffic reaches the replacement: the ingress's router learns of a new
    # replica through Serve's long poll, which can lag its registration.
    probe = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}  # no full block cached

    def routed_to_all() -> bool:
        return (
            len({handle.generate.remote(probe).result()["kvmesh"]["worker"] for _ in range(n)}) == n
        )

    wait_for(routed_to_all, 30, "routing to every replica", every=0.5)


# Seven-letter words: where a word stands depends on every character before it, so a new
# worker's matcher that did not take the resumed tokens would break the pattern.
WORDS = r"([a-z]{7} )*[a-z]{0,7}"
HELD = {**SAMPLED, "structured_outputs": {"regex": r"([a-z]{7} )+"}}


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, SAMPLED, HELD], ids=["greedy", "seeded", "structured"]
)
def test_stream_resumes_on_another_replica_with_the_same_tokens(app, sampling) -> None:
    body = {**LONG, **sampling}
    unbroken = app.generate.remote(body).result()
    chunks, killed = _stream(app, body, 40, lambda: _kill_busy(app))
    tokens = [t for c in chunks for t in c["token_ids"]]
    assert tokens == unbroken["token_ids"]  # nothing lost, nothing repeated
    assert "".join(c["text"] for c in chunks) == unbroken["text"]
    if "structured_outputs" in sampling:
        assert re.fullmatch(WORDS, unbroken["text"]), unbroken["text"]
    last = chunks[-1]
    assert last["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 400
    assert last["usage"]["prompt_tokens"] == len(PROMPT)
    assert last["kvmesh"]["migrations"] == 1
    assert last["kvmesh"]["worker"] != killed
    _healed(app)


def test_non_streaming_request_resumes(app) -> None:
    body = {**LONG, **SAMPLED, "seed": 11, "logprobs": 1, "prompt_logprobs": 1}
    unbroken = app.generate.remote(body).result()
    pending = app.generate.remote(body)
    kill_worker(wait_for(lambda: busy_worker(app), 10, "the busy worker", every=0.02))
    out = pending.result()
    assert out["token_ids"] == unbroken["token_ids"]
    assert out["text"] == unbroken["text"]
    assert out["kvmesh"]["migrations"] == 1
    assert len(out["logprobs"]) == len(out["token_ids"])
    for tok, entry in zip(out["token_ids"], out["logprobs"], strict=True):
        assert tok in entry
    # The prompt's logprobs came once, from whichever worker computed the prompt.
    assert len(out["prompt_logprobs"]) == len(PROMPT) and out["prompt_logprobs"][0] is None
    pairs = zip(out["prompt_logprobs"][1:], unbroken["prompt_logprobs"][1:], strict=True)
    for (got, want), tok in zip(pairs, PROMPT[1:], strict=True):
        assert got[tok] == pytest.approx(want[tok], abs=1e-5)
    _healed(app)


def test_requests_sent_to_a_dead_replica_are_routed_again(app) -> None:
    victim = next(iter(app.stats.remote().result()["workers"]))
    kill_worker(victim)
    calls = [
        app.generate.remote({"prompt": [3, 4, 5, i], "max_tokens": 4, "temperature": 0})
        for i in range(6)
    ]
    outs = [c.result() for c in calls]
    assert all(o["finish_reason"] == "length" and len(o["token_ids"]) == 4 for o in outs)
    assert all(o["kvmesh"]["worker"] != victim for o in outs)
    _healed(app)


def test_replacement_registers_and_pulls_a_prefix(app) -> None:
    before = set(app.stats.remote().result()["workers"])
    victim = sorted(before)[0]
    kill_worker(victim)
    wait_for(lambda: victim not in app.stats.remote().result()["workers"], 10, "the index purge")
    _healed(app)
    after = set(app.stats.remote().result()["workers"])
    (new,) = after - before
    prompt = list(range(200, 300))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = app.generate.remote(body).result()
    # Round robin: one of the next two lands on the replacement, which pulls the prefix
    # (unless it computed it first itself, then the other pulls from it).
    outs = [app.generate.remote(body).result() for _ in range(2)]
    assert all(o["token_ids"] == first["token_ids"] for o in outs)
    served = [first, *outs]
    assert new in {o["kvmesh"]["worker"] for o in served}
    assert all(o["kvmesh"]["computed_tokens"] < len(prompt) for o in served[1:])
    assert any(o["kvmesh"]["pulled_tokens"] > 0 for o in served[1:])


def test_a_hung_engine_is_killed_and_its_stream_moves(app) -> None:
    """An engine that answers nothing (its process stopped, as a wedged device leaves it):
    after two silent health checks its replica kills it and the stream moves to the other
    worker with the unbroken run's tokens, instead of waiting out Serve's graceful drain of
    an unhealthy replica (drain_timeout_s, 30 s) on a process that will not finish it."""
    body = {**LONG, "temperature": 0}
    unbroken = app.generate.remote(body).result()

    def stop_the_engine() -> tuple[str, int, float]:
        """SIGSTOP the engine process of the worker that runs the stream: (worker, pid, when)."""
        worker = wait_for(lambda: busy_worker(app), 10, "the busy worker")
        engines = ray.get(get_index_actor(served_fingerprint()).workers.remote())
        pid = actor_pid(engines[worker]["handle"])
        os.kill(pid, signal.SIGSTOP)
        return worker, pid, time.monotonic()

    chunks, (worker, pid, stopped_at) = _stream(app, body, 5, stop_the_engine)
    took = time.monotonic() - stopped_at
    assert [t for c in chunks for t in c["token_ids"]] == unbroken["token_ids"]
    last = chunks[-1]["kvmesh"]
    assert last["migrations"] == 1 and last["worker"] != worker
    assert took < 20.0, f"the stream waited {took:.0f} s for its hung worker"
    # Killed by its replica: ray.kill returns once the actor is marked dead, and Ray sends the
    # stopped process its SIGKILL after asking it to exit (which it cannot answer).
    wait_for(lambda: not process_alive(pid), 15, "the hung engine's process to end", every=0.2)
    _healed(app)


def test_a_hung_worker_replicas_stream_moves(app) -> None:
    """A worker replica whose process hangs (stopped) mid-stream: its call sends nothing,
    not even a keep-alive, so after ``SILENT_PERIODS`` health-check periods the ingress
    moves the stream to the other worker with the unbroken run's tokens. Serve alone would
    leave it waiting for three failed health checks and a graceful stop the hung process
    cannot answer (about 45 s with this app's settings). Serve then replaces it at once."""
    body = {**LONG, "temperature": 0}
    unbroken = app.generate.remote(body).result()

    stopped: list[int] = []

    def stop_the_replica() -> tuple[str, float]:
        worker = wait_for(lambda: busy_worker(app), 10, "the busy worker")
        pid = actor_pid(replica_actor(worker))
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        return worker, time.monotonic()

    try:
        chunks, (worker, stopped_at) = _stream(app, body, 5, stop_the_replica)
        took = time.monotonic() - stopped_at
        # Serve still lists the stopped replica: new requests avoid it too (round robin
        # sent every other one there, each to wait out a silence of its own).
        short = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        later = [app.generate.remote(short).result()["kvmesh"] for _ in range(4)]
        # Left stopped: Serve kills it after three failed health checks (5 s each here) and
        # starts a replacement. Before, it first drained it for drain_timeout_s (30 s),
        # which a hung process cannot end, and its replacement waited for its CPUs.
        _healed(app)
        healed = time.monotonic() - stopped_at
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):  # Serve's own kill came first
                os.kill(pid, signal.SIGKILL)
    assert [t for c in chunks for t in c["token_ids"]] == unbroken["token_ids"]
    last = chunks[-1]["kvmesh"]
    assert last["migrations"] == 1 and last["worker"] != worker
    assert took < 10.0, f"the stream waited {took:.0f} s for its hung replica"
    assert [(k["worker"] != worker, k["migrations"]) for k in later] == [(True, 0)] * 4
    print(f"a hung worker replica replaced, its replacement serving {healed:.1f} s after")
    assert healed < 35.0, f"the hung worker replica's replacement served after {healed:.0f} s"


def test_a_request_lost_before_its_hung_worker_said_anything_is_avoided_after(app) -> None:
    """A replica stopped while idle: a request routed there sends nothing, not even a
    keep-alive, so only the router knows where it went (``routed_to``). Once lost there, the
    ingress avoids that worker for the requests after it. Before, round robin sent every
    other request to the stopped replica, each to wait out a silence of its own."""
    workers = sorted(app.stats.remote().result()["workers"])
    stopped = workers[0]
    pid = actor_pid(replica_actor(stopped))
    os.kill(pid, signal.SIGSTOP)
    try:
        short = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
        sent = [app.generate.remote(short).result()["kvmesh"] for _ in range(4)]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a crash now: Serve replaces it at once
    assert all(k["worker"] != stopped for k in sent)
    assert sum(k["migrations"] for k in sent) <= 1, [k["migrations"] for k in sent]
    _healed(app)


def test_a_worker_that_answers_again_is_used_again(app) -> None:
    """A replica that stopped answering for a few seconds (a paused process; a cut link that
    came back) and then answers: the ingress avoids it only until it answers a probe. Before,
    it was avoided for ``AVOID_S`` (30 s) after the loss, and the other worker took every
    request meanwhile."""
    workers = sorted(app.stats.remote().result()["workers"])
    paused = workers[0]
    pid = actor_pid(replica_actor(paused))
    short = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    os.kill(pid, signal.SIGSTOP)
    try:  # shorter than Serve's health-check timeout (5 s here): the replica stays listed
        moved = [app.generate.remote(short).result()["kvmesh"] for _ in range(2)]
    finally:
        os.kill(pid, signal.SIGCONT)
    resumed = time.monotonic()
    assert [k["migrations"] for k in moved].count(1) == 1, moved  # one was lost there
    assert all(k["worker"] != paused for k in moved)

    def served_by_paused() -> bool:
        return any(app.generate.remote(short).result()["kvmesh"]["worker"] == paused for _ in "ab")

    wait_for(served_by_paused, 10, "a request on the worker that answers again", every=0.2)
    took = time.monotonic() - resumed
    assert took < 5.0, f"the worker was avoided {took:.1f} s after it answered again"
    _healed(app)


def test_index_killed_under_load_fails_no_request(app) -> None:
    fingerprint = served_fingerprint()
    bodies = [
        {"prompt": [*PROMPT, i], "max_tokens": 60, "ignore_eos": True, "temperature": 0}
        for i in range(12)
    ]
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(lambda b=b: app.generate.remote(b).result()) for b in bodies]
        time.sleep(0.3)
        ray.kill(get_index_actor(fingerprint))  # for good: workers must recreate it by name
        killed_at = time.monotonic()
        outs = [f.result() for f in futures]
    assert all(len(o["token_ids"]) == 60 for o in outs)

    def registered() -> bool:
        try:
            return len(ray.get(get_index_actor(fingerprint).workers.remote(), timeout=2)) == 2
        except Exception:
            return False

    wait_for(registered, 10, "both workers in the new index")
    assert time.monotonic() - killed_at < 10
    # The ingress finds the new index too: /metrics and stats list the workers again.
    assert len(app.stats.remote().result()["workers"]) == 2
    # And the cluster still shares KV: the second of two requests for a prompt pulls it
    # (round robin puts them on different workers).
    prompt = list(range(220, 300))
    outs = [
        app.generate.remote({"prompt": prompt, "max_tokens": 2, "temperature": 0}).result()
        for _ in range(2)
    ]
    assert outs[1]["kvmesh"]["computed_tokens"] < len(prompt)


def test_a_full_worker_keeps_every_call_alive(app) -> None:
    """More calls at once on a worker than its engine actor had stream threads (64 before):
    Ray queued the rest, which sent nothing, not even a keep-alive, so each counted as lost
    on a healthy worker after ``SILENT_PERIODS`` periods (2.5 s here) and moved. The engine
    actor now takes every call Serve may send its replica (a coroutine each)."""
    n = 160  # 80 a worker: round robin
    bodies = [
        {"prompt": [*PROMPT, i], "max_tokens": 300, "ignore_eos": True, "temperature": 0}
        for i in range(n)
    ]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        outs = list(pool.map(lambda b: app.generate.remote(b).result(), bodies))
    assert [o["kvmesh"]["migrations"] for o in outs] == [0] * n
    assert all(len(o["token_ids"]) == 300 for o in outs)
