"""The Serve topology scales: several ingress replicas route as one, worker deployments
autoscale, and a wedged worker fails its health check. Real Ray Serve, tiny-random."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time

import pytest

from kvmesh import LLM, SamplingParams
from kvmesh.cluster.request_router import INDEX_TIMEOUT_S
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.worker import Worker
from tests.ray_fixtures import actor_pid, ray_session  # noqa: F401
from tests.serve_helpers import (
    redeploy,
    replica_log,
    running_replicas,
    served_fingerprint,
    tiny_config,
    undeploy,
    wait_for,
)

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]
BACK = "index answers again"  # the router's log line when its probe hears from the index


@pytest.fixture(scope="module")
def reference() -> LLM:
    """The kv_aware tests' model in process, for their expected outputs."""
    return LLM(KV_AWARE["model"], block_size=4, num_kv_blocks=256, progress=False)


# The model of the kv_aware tests: a real one, whose prompt tokens cost what a pull saves.
# On tiny-random computing 200 tokens costs about what pulling them does (both ~ms of fixed
# overhead), so whether a burst waited and pulled or computed the prefix again was a coin
# the learned costs tossed, and the tests failed now and then.
KV_AWARE = {"model": "smollm2-135m", "kv_cache_memory": "128MiB"}


@pytest.fixture(scope="module")
def kv_aware_pair():
    """3 workers behind 2 ingress replicas, each with its own kv_aware router (one app for
    the two tests below: their prefixes share no block)."""
    yield redeploy(tiny_config(workers=3, router="kv_aware", ingress_replicas=2, **KV_AWARE))
    undeploy()


def test_two_ingress_replicas_compute_a_shared_prefix_once(kv_aware_pair) -> None:
    """8 prompts sharing a 512-token prefix, sent at once through 2 ingress replicas (each
    with its own router) to 3 workers: the prefix is computed once, the rest pulled or hit."""
    handle = kv_aware_pair
    shared = [10 + (i * 7) % 300 for i in range(512)]  # 128 full blocks of 4
    prompts = [[*shared, 5 + i, 6 + i, 7 + i] for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(
            pool.map(
                lambda p: handle.generate.remote(
                    {"prompt": p, "max_tokens": 2, "temperature": 0}
                ).result(),
                prompts,
            )
        )
    computed = sum(o["kvmesh"]["computed_tokens"] for o in outs)
    expected = len(shared) + sum(len(p) - len(shared) for p in prompts)
    assert computed == expected, [o["kvmesh"] for o in outs]


def test_kv_aware_burst_computes_a_shared_prefix_once(kv_aware_pair, reference) -> None:
    """Six prompts sharing a 200-token prefix arrive together on three workers: the prefix
    is computed by one worker; the others wait for it and pull it (or hit it locally), and
    every answer equals a single engine's."""
    handle = kv_aware_pair
    shared = list(range(100, 300))  # 50 full blocks of 4
    prompts = [[*shared, 7 + i, 9 + i, 11 + i] for i in range(6)]
    params = SamplingParams(max_tokens=4, temperature=0)
    # The index outlives an app (it is the model's): earlier tests' refusals count there.
    refused_before = handle.stats.remote().result()["index"].get("unauthorized", 0)
    calls = [
        handle.generate.remote({"prompt": p, "max_tokens": 4, "temperature": 0}) for p in prompts
    ]
    outs = [c.result() for c in calls]
    want = reference.generate(prompts, params)
    assert [o["token_ids"] for o in outs] == [w.token_ids for w in want]
    computed = sum(o["kvmesh"]["computed_tokens"] for o in outs)
    assert computed == len(shared) + sum(len(p) - len(shared) for p in prompts), str(
        [o["kvmesh"] for o in outs]
    )
    assert len({o["kvmesh"]["worker"] for o in outs}) >= 2
    # The workers vouched for the router's pending entries (else each is believed for
    # UNCONFIRMED_TTL_S only), and no confirmation was refused.
    index = wait_for(
        lambda: (s := handle.stats.remote().result()["index"])["pending_confirmed"] and s,
        10,
        "the workers to confirm the pending entries",
    )
    assert index["pending_confirmed"] <= index["pending_added"]
    assert index["unauthorized"] == refused_before


def test_a_hung_index_delays_one_request_not_each() -> None:
    """The index's process stopped (alive, silent): the kv_aware router waits for it once
    (INDEX_TIMEOUT_S), then routes by load while a probe in the background waits for it, so
    the requests meanwhile are as fast as ever; once it runs again, routing uses it again."""
    handle = redeploy(tiny_config(workers=2, router="kv_aware"))
    try:
        index = get_index_actor(served_fingerprint())
        pid = actor_pid(index)
        body = {"prompt": list(range(40, 90)), "max_tokens": 2, "temperature": 0}
        handle.generate.remote(body).result()
        seconds = []
        back_before = replica_log("KvmeshServer").count(BACK)
        os.kill(pid, signal.SIGSTOP)
        try:
            end = time.monotonic() + 3 * INDEX_TIMEOUT_S
            while time.monotonic() < end:
                start = time.monotonic()
                handle.generate.remote(body).result(timeout_s=30)
                seconds.append(time.monotonic() - start)
        finally:
            os.kill(pid, signal.SIGCONT)
        slow = [s for s in seconds if s > INDEX_TIMEOUT_S / 2]
        assert len(slow) == 1 and len(seconds) >= 10, seconds
        # Back: the probe heard from it, and routing asks it again.
        wait_for(
            lambda: replica_log("KvmeshServer").count(BACK) > back_before,
            10,
            "the router to use the index again",
        )
    finally:
        undeploy()


def test_workers_autoscale_up_under_load_and_back() -> None:
    config = tiny_config(
        workers=1, max_workers=2, target_ongoing_requests=1.0, downscale_delay_s=2.0
    )
    handle = redeploy(config)
    try:
        assert running_replicas() == 1
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                handle.generate.remote(
                    {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True}
                ).result()

        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: running_replicas() == 2, 90, "a second replica", every=0.5)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        stopped = time.monotonic()
        wait_for(lambda: running_replicas() == 1, 90, "back to one replica", every=0.5)
        # Load reported every METRICS_INTERVAL_S and averaged over LOOK_BACK_S: ~5.5 s here,
        # 14-22 s with the settings before (Serve's 10-s report interval, a 15-s window).
        assert time.monotonic() - stopped < 10.0
    finally:
        undeploy()


def test_a_wedged_step_thread_fails_the_health_check() -> None:
    worker = Worker("w", EngineConfig(model="tiny-random", block_size=4, num_kv_blocks=64))
    try:
        worker.check_health(0.2)  # idle: healthy however long it has been
        release = threading.Event()
        real_step = worker.engine.step
        worker.engine.step = lambda: release.wait(30) and real_step()  # a hung kernel
        deltas = worker.stream([1, 2, 3, 4])
        threading.Thread(target=lambda: list(deltas), daemon=True).start()
        time.sleep(0.5)
        with pytest.raises(RuntimeError, match="no progress"):
            worker.check_health(0.2)
        release.set()
        worker.engine.step = real_step
        wait_for(lambda: not worker.engine.has_unfinished(), 10, "the request to finish")
        worker.check_health(0.2)
    finally:
        worker.shutdown()
