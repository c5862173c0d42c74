"""A caller that goes away (``ray.cancel`` of its stream: a closed HTTP connection, a lost
ingress) frees its request in the worker actor at once, also one that still waits for its
turn: that one has sent no token yet, so a check between tokens never saw it, and it was
prefilled for nobody once its turn came."""

from __future__ import annotations

import random
import time

import pytest
import ray

from kvmesh import SamplingParams
from tests.cluster_helpers import start_workers, stop_workers
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import wait_for

pytestmark = pytest.mark.usefixtures("ray_session")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def test_a_cancelled_request_still_waiting_is_aborted_at_once() -> None:
    (worker,) = start_workers(1, connector=False, num_kv_blocks=512, max_num_seqs=1)
    try:

        def occupancy() -> dict[str, int]:
            return ray.get(worker.occupancy.remote())

        long = worker.generate_stream.remote(
            prompt(1, 9), SamplingParams(max_tokens=1900, ignore_eos=True)
        )
        wait_for(lambda: occupancy()["running"] == 1, 30, "the long request to run")
        queued = worker.generate_stream.remote(prompt(2, 9), SamplingParams(max_tokens=4))
        wait_for(lambda: occupancy()["waiting"] == 1, 10, "the second request to wait")
        ray.cancel(queued)
        cancelled = time.monotonic()
        wait_for(lambda: occupancy()["waiting"] == 0, 10, "the waiting request to go")
        assert time.monotonic() - cancelled < 1.0
        assert occupancy()["running"] == 1  # the long one goes on
        ray.cancel(long)
        wait_for(lambda: occupancy()["running"] == 0, 10, "the long request to go")
    finally:
        stop_workers([worker])
