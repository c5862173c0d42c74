"""A worker actor's streams are coroutines, not threads (workers/worker_actor.py).

As a threaded actor it started a thread for every stream its caller might send (112 threads
idle with the default 64 streams; ~330 under `kvmesh serve`, whose replicas may send ~270),
whether any came or not. Now 48 open streams run on one event loop: the process has fewer
threads than streams, the control group still answers at once, and a cancelled stream
(a client gone) aborts its request within a step or two.
"""

from __future__ import annotations

import os
import time

import pytest
import ray

from kvmesh import SamplingParams
from tests.cluster_helpers import start_workers, stop_workers, wait_until
from tests.ray_fixtures import ray_session  # noqa: F401

STREAMS = 48


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.usefixtures("ray_session")
def test_open_streams_hold_no_thread_and_a_cancel_aborts_at_once() -> None:
    (w,) = start_workers(1, connector=False, num_kv_blocks=STREAMS * 40)
    try:
        pid = ray.get(w.ready.remote())["pid"]
        params = SamplingParams(max_tokens=120, ignore_eos=True)
        gens = [
            w.generate_stream.remote([1, 2, 3, i], params, interval_s=0.05) for i in range(STREAMS)
        ]
        ray.get([next(g) for g in gens])  # every stream has begun
        assert ray.get(w.occupancy.remote())["running"] == STREAMS
        assert threads(pid) < STREAMS
        started = time.monotonic()
        ray.get(w.health.remote(60.0), timeout=5)  # the control group is not starved
        assert time.monotonic() - started < 2.0
        for g in gens:
            ray.cancel(g)
        assert wait_until(lambda: ray.get(w.occupancy.remote())["running"] == 0, 5.0)
        assert ray.get(w.occupancy.remote())["free_blocks"] == STREAMS * 40
    finally:
        stop_workers([w])
