"""The router's plan on real Ray workers with NIXL, and a slow read that stops no stream.

A valid plan is pulled from without an index lookup (the connector counts its lookups); a stale
one (a holder the worker does not know, or one that refuses the pin) falls back to the worker's
own lookup; a plan without a holder pulls nothing and looks nothing up. And a read that hangs
for its whole timeout (injected on purpose) on a real worker: its stream keeps decoding.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import ray

from kvmesh import SamplingParams
from kvmesh.cluster.worker_deployment import pull_plan
from kvmesh.cluster.worker_request import Plan
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.connector.transfer_faults import TransferFaults
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.kv_connector import PullPlan
from kvmesh.workers.worker_actor import worker_actor_class
from tests.async_load_helpers import (
    BS,
    GREEDY,
    NUM_BLOCKS,
    OTHER,
    PREFIX,
    key,
    prompt,
    reference_tokens,
)
from tests.cluster_helpers import flush, start_workers, stop_workers, wait_until
from tests.ray_fixtures import ray_session  # noqa: F401


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    return reference_tokens()


def test_the_router_plan_becomes_the_workers_pull_plan() -> None:
    assert pull_plan(None, "worker") is None  # no plan: the worker looks for itself
    plan = Plan("worker-b", local_blocks=2, pull_blocks=5, holder="worker-a")
    assert pull_plan(plan, "worker") == PullPlan("worker-a", 7)
    waiting = Plan("worker-b", holder="worker-a", wait_for="worker-a", wait_blocks=9)
    assert pull_plan(waiting, "worker") == PullPlan("worker-a", 9)
    # The router planned no pull from a holder it sized: nothing to pull, no lookup.
    assert pull_plan(Plan("worker-b", local_blocks=4, holder="worker-a"), "worker") == PullPlan(
        None
    )
    assert pull_plan(Plan("worker-b"), "worker") == PullPlan(None)
    # A prefill worker is not among a decode router's replicas: unsized, so look it up.
    assert pull_plan(Plan("decode-b", holder="prefill-a"), "decode") is None
    with pytest.raises(ValueError, match="depth"):
        PullPlan("worker-a", -1)


def stats(w: object) -> dict[str, float]:
    return ray.get(w.connector_stats.remote())  # type: ignore[attr-defined]


def worker_id(w: object) -> str:
    return ray.get(w.ready.remote())["worker_id"]  # type: ignore[attr-defined]


@pytest.mark.usefixtures("ray_session")
def test_the_plan_is_used_and_a_stale_one_falls_back(reference: dict) -> None:
    a, b = start_workers(2, num_kv_blocks=NUM_BLOCKS)
    try:
        a_id = worker_id(a)
        depth = (len(PREFIX) - 1) // BS
        # Each worker registered the node its KV lives on (routers and peers pull from the
        # nearest holder): this one-node cluster's.
        fingerprint = ray.get(a.ready.remote())["fingerprint"]
        nodes = ray.get(get_index_actor(fingerprint).route_lookup.remote([]))["nodes"]
        here = ray.get_runtime_context().get_node_id()
        assert nodes == {a_id: here, worker_id(b): here}
        ray.get(a.generate.remote(PREFIX, GREEDY))
        flush([a])
        assert wait_until(lambda: stats(b)["known_peers"] >= 1, 15)

        # A valid plan: b pulls from a without asking the index.
        before = stats(b)
        out = ray.get(b.generate.remote(PREFIX, GREEDY, pull_plan=PullPlan(a_id, depth)))
        after = stats(b)
        assert out.metrics.num_pulled_tokens == depth * BS
        assert out.metrics.num_read_blocks == depth and out.metrics.read_s > 0
        assert out.metrics.read_from == a_id  # whose link the read's cost is
        assert out.token_ids == reference[key(PREFIX, GREEDY)]
        assert after["index_lookups"] == before["index_lookups"]
        assert after["pulls"] == before["pulls"] + 1

        # A plan naming a worker b does not know: b looks the index up itself, pulls from a.
        ids = prompt(3, 33)
        ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        before = stats(b)
        out = ray.get(b.generate.remote(ids, GREEDY, pull_plan=PullPlan("w-gone", 8)))
        after = stats(b)
        assert out.metrics.num_pulled_tokens == 8 * BS
        assert after["stale_plans"] > before["stale_plans"]
        assert after["index_lookups"] > before["index_lookups"]

        # A plan whose holder refuses the pin (it never held the prefix): b asks the index
        # (nobody else holds it) and computes.
        ids = prompt(4, 33)
        before = stats(b)
        out = ray.get(b.generate.remote(ids, GREEDY, pull_plan=PullPlan(a_id, 8)))
        after = stats(b)
        assert out.metrics.num_pulled_tokens == 0
        assert out.metrics.num_read_blocks == 0  # refused at the pin: nothing was read
        assert after["pull_failures"] == before["pull_failures"] + 1
        assert after["index_lookups"] == before["index_lookups"] + 1

        # A plan without a holder: nothing to pull, and no index lookup either.
        ids = prompt(5, 33)
        ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        before = stats(b)
        out = ray.get(b.generate.remote(ids, GREEDY, pull_plan=PullPlan(None)))
        assert out.metrics.num_pulled_tokens == 0
        assert stats(b)["index_lookups"] == before["index_lookups"]
    finally:
        stop_workers([a, b])


@pytest.mark.usefixtures("ray_session")
def test_a_slow_read_on_a_real_worker_stops_no_stream(reference: dict) -> None:
    """b's every NIXL read hangs for its whole timeout (2 s) and then fails (a fault injected
    on purpose): its stream keeps decoding meanwhile, and the pulled prompt is computed."""
    cfg = EngineConfig("tiny-random", block_size=BS, num_kv_blocks=512, progress=False)
    slow = TransferFaults(timeout_rate=1.0)
    cls = worker_actor_class(num_gpus=0, num_cpus=0)
    a = cls.remote("w-slow-holder", cfg, ClusterConnectorConfig("nixl", timeout_s=10.0), 1)
    conn = ClusterConnectorConfig("nixl", lease_s=10.0, timeout_s=2.0, faults=slow)
    b = cls.remote("w-slow-puller", cfg, conn, 1)
    try:
        a_id = worker_id(a)
        worker_id(b)
        ray.get(a.generate.remote(PREFIX, GREEDY))
        flush([a])
        assert wait_until(lambda: stats(b)["known_peers"] >= 1, 15)
        times: list[float] = []

        def stream_other() -> None:
            params = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
            with contextlib.suppress(ray.exceptions.RayError):  # b is stopped under it
                for ref in b.generate_stream.remote(OTHER, params):
                    n = len(ray.get(ref).token_ids)  # tokens that piled up come merged
                    times.extend([time.monotonic()] * n)

        streamer = threading.Thread(target=stream_other, daemon=True)
        streamer.start()
        assert wait_until(lambda: len(times) >= 5, 30, 0.01)
        start = time.monotonic()
        plan = PullPlan(a_id, (len(PREFIX) - 1) // BS)
        out = ray.get(b.generate.remote(PREFIX, GREEDY, pull_plan=plan), timeout=60)
        took = time.monotonic() - start
        during = [t for t in times if start + 0.2 < t < start + 1.8]
        assert took >= 2.0  # the read did hang for its timeout
        assert out.metrics.num_pulled_tokens == 0
        # The failed read is this request's: its time is what the router learns pulls cost.
        assert out.metrics.num_read_blocks == plan.depth and out.metrics.read_s >= 2.0
        assert out.token_ids == reference[key(PREFIX, GREEDY)]
        assert len(during) >= 10, f"{len(during)} stream tokens while the read hung"
        assert stats(b)["injected_timeout"] == 1
    finally:
        stop_workers([a, b])
