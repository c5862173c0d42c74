"""Ingress replicas lost or hung: real Ray Serve and the tiny-random model, over HTTP with the
official client. A client that hangs up, and an ingress replica killed mid-request, free the
worker; a stopped ingress replica freezes no worker replica; a hung ingress replica is
replaced within Serve's health checks on it."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
import ray
from ray import serve

from kvmesh.cluster.api_error import ApiError
from kvmesh.cluster.front_door import LOST
from kvmesh.cluster.liveness import ENGINE_NAMESPACE, engine_actor_name
from kvmesh.cluster.serve_app import APP_NAME, INGRESS_DEPLOYMENT, WORKER_DEPLOYMENT_PREFIX
from tests.ray_fixtures import actor_pid, ray_session  # noqa: F401
from tests.serve_helpers import (
    busy_worker,
    redeploy,
    replica_log,
    tiny_config,
    undeploy,
    wait_for,
)

PROMPT = list(range(7, 90))


@pytest.fixture(scope="module")
def served(ray_session):  # noqa: F811
    config = tiny_config(workers=1, router="round_robin", health_check_period_s=0.5)
    yield redeploy(config), config
    undeploy()


def _ingress_replicas() -> list[str]:
    prefix = f"SERVE_REPLICA::{APP_NAME}#{INGRESS_DEPLOYMENT}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return [n for n in names if n.startswith(prefix)]


def _long_http_stream(app, config, max_tokens: int) -> Any:
    """An HTTP stream of ``max_tokens`` (ignoring EOS), read for 10 chunks: its worker busy."""
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.port}/v1", api_key="none", max_retries=0
    )
    stream = client.completions.create(
        model=config.model_name,
        prompt=PROMPT,
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(10), stream, strict=False):
        pass
    assert wait_for(lambda: busy_worker(app), 10, "the busy worker")
    return stream


def test_a_client_that_hangs_up_frees_the_worker(served) -> None:
    """A stream closed by its HTTP client is aborted on its worker within a second or two
    (the request leaves the batch and frees its blocks)."""
    app, config = served
    stream = _long_http_stream(app, config, 1500)
    stream.close()
    closed = time.monotonic()
    wait_for(lambda: busy_worker(app) is None, 10, "the worker to drop the request", every=0.05)
    assert time.monotonic() - closed < 2.0


def test_a_lost_ingress_replicas_requests_are_aborted_on_their_workers(served) -> None:
    """An ingress replica killed mid-request: Ray does not cancel the worker's actor task
    of a caller that died, so the worker replica checks its callers and aborts the request
    within a few health-check periods, instead of running it to max_tokens for nobody.
    Its clients lose nothing they can't see: the stream ends with OpenAI's error event,
    and a request not yet answered is sent again by the front door and answered whole by
    the replacement (before: a reset connection and a 500). So for handle callers: a
    handle stream ends with the front door's 503 and a handle request is answered whole
    (before: Ray's ActorDiedError for both, with the replica's actor id and pid)."""
    app, config = served
    stream = _long_http_stream(app, config, 1900)
    engine = ray.get_actor(engine_actor_name(busy_worker(app)), namespace=ENGINE_NAMESPACE)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.port}/v1", api_key="none", max_retries=0, timeout=120
    )
    # Long enough to outlast the worker's check on its callers: a short one (300 tokens,
    # ~0.4 s here) could end before the check and leave it 1 running request to abort.
    pending = ThreadPoolExecutor(1).submit(
        client.completions.create,
        model=config.model_name,
        prompt=PROMPT[:40],
        max_tokens=1500,
        extra_body={"ignore_eos": True},
    )
    handle_stream = app.options(stream=True).generate.remote(
        {"prompt": PROMPT[:20], "max_tokens": 1900, "ignore_eos": True, "stream": True}
    )
    next(handle_stream)  # a chunk came: started
    handle_pending = app.generate.remote(
        {"prompt": PROMPT[:30], "max_tokens": 1500, "ignore_eos": True}
    )
    wait_for(
        lambda: ray.get(engine.occupancy.remote())["running"] == 4,
        10,
        "the four requests running",
        every=0.02,
    )
    [ingress] = _ingress_replicas()
    ray.kill(ray.get_actor(ingress, namespace="serve"), no_restart=True)
    killed = time.monotonic()
    aborted = "the caller of 4 running requests is gone; aborting them"
    log = f"{WORKER_DEPLOYMENT_PREFIX}worker"
    wait_for(lambda: aborted in replica_log(log), 10, "the worker to abort", every=0.1)
    assert time.monotonic() - killed < 5.0
    with pytest.raises(openai.APIError, match=LOST):
        for _ in stream:
            pass
    completion = pending.result(timeout=90)
    assert completion.usage.completion_tokens == 1500
    with pytest.raises(ApiError, match=LOST) as lost:
        for _ in handle_stream:
            pass
    assert lost.value.status == 503
    answer = handle_pending.result(timeout_s=90)
    assert answer["usage"]["completion_tokens"] == 1500 and len(answer["token_ids"]) == 1500

    def idle() -> bool:
        try:
            return busy_worker(app) is None
        except Exception:  # the handle's call reached the dead ingress: it is being replaced
            return False

    wait_for(idle, 60, "the replacement ingress to find the worker idle", every=0.5)


def _pid(actor_name: str) -> int:
    return actor_pid(ray.get_actor(actor_name, namespace="serve"))


def test_a_stopped_ingress_replica_does_not_freeze_its_worker(served) -> None:
    """An ingress replica's process stopped while a worker streams to it. Ray ends a
    streaming call by waiting, on the callee's event loop, until the caller acknowledged
    every item it was sent. A stopped caller acknowledges nothing, so the whole worker replica
    froze: its other calls, and Serve's health checks on it (with Serve's defaults it was
    replaced, KV cache and all, after three timed-out checks). Now the worker ends such a
    call only once its caller answers, and keeps serving meanwhile."""
    app, config = served
    stream = _long_http_stream(app, config, 1900)
    worker = busy_worker(app)
    [ingress] = _ingress_replicas()
    pid = _pid(ingress)
    engine = ray.get_actor(engine_actor_name(worker), namespace=ENGINE_NAMESPACE)
    workers = serve.get_deployment_handle(f"{WORKER_DEPLOYMENT_PREFIX}worker", APP_NAME)
    os.kill(pid, signal.SIGSTOP)
    try:
        # The request runs on to its max_tokens for nobody, and its call ends.
        wait_for(
            lambda: ray.get(engine.occupancy.remote())["running"] == 0, 10, "the request's end"
        )
        time.sleep(0.5)
        # Its replica still answers calls (an async method: it runs on the frozen loop).
        for _ in range(3):
            started = time.monotonic()
            assert workers.worker_info.remote().result(timeout_s=3.0)["worker_id"] == worker
            assert time.monotonic() - started < 1.0
            time.sleep(0.3)
    finally:
        os.kill(pid, signal.SIGCONT)
    stream.close()
    wait_for(lambda: busy_worker(app) is None, 10, "the worker to be idle")


def test_a_hung_ingress_replica_is_replaced_within_seconds(served) -> None:
    """An ingress replica whose process hangs (stopped): Serve's proxy sends it new requests,
    each to hang, until three health checks on it fail in a row. With the workers' period
    and a timeout of five periods that is ~8 s here; with Serve's default check (every
    10 s, a 30-s timeout) it was ~90 s, whatever kvmesh's period."""
    _, config = served
    [name] = _ingress_replicas()
    pid = _pid(name)
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{config.port}/v1", api_key="none", max_retries=0, timeout=2.0
    )

    def answered() -> bool:
        try:
            client.completions.create(model=config.model_name, prompt=PROMPT, max_tokens=1)
        except (openai.APITimeoutError, openai.APIStatusError, openai.APIConnectionError):
            return False
        return True

    assert answered()
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        wait_for(answered, 40, "an answer from a replacement ingress replica", every=0.5)
        took = time.monotonic() - stopped
    finally:
        with contextlib.suppress(ProcessLookupError):  # Serve's own kill came first
            os.kill(pid, signal.SIGKILL)
    print(f"a hung ingress replica replaced, answering after {took:.1f} s")
    assert took < 30.0, f"the hung ingress replica was replaced after {took:.0f} s"
    assert set(_ingress_replicas()) - {name}, "no replacement ingress replica"
