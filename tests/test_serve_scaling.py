"""The Serve topology scales: several ingress replicas route as one, worker deployments
autoscale, and a wedged worker fails its health check. Real Ray Serve, tiny-random."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest

from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.worker import Worker
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import redeploy, running_replicas, tiny_config, undeploy, wait_for

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.slow]


def test_two_ingress_replicas_compute_a_shared_prefix_once() -> None:
    """8 prompts sharing a 512-token prefix, sent at once through 2 ingress replicas (each
    with its own router) to 3 workers: the prefix is computed once, the rest pulled or hit."""
    handle = redeploy(tiny_config(workers=3, router="kv_aware", ingress_replicas=2))
    try:
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
        wait_for(lambda: running_replicas() == 1, 90, "back to one replica", every=0.5)
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
