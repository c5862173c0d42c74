"""Which peer a pull comes from: the deepest holder; among equals the cheapest measured link,
then one on the puller's own node, then by name. One rule (``nearest_holder``) for the
router's plan and for a worker that looks the index up itself; the index tells both where
each worker's KV lives (its registration's ``node``). Before, equal holders went by name, so
a worker pulled across the network from another host as often as from its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from kvmesh.cluster.request_router import _holder
from kvmesh.cluster.router import Router, WorkerView
from kvmesh.connector.async_load import PullLoader
from kvmesh.connector.cluster_connector_config import ClusterConnectorConfig
from kvmesh.connector.events import Stored
from kvmesh.connector.holder_sets import nearest_holder
from kvmesh.workers.kv_connector import PullPlan
from tests.kv_index_helpers import BASE, FP, Index, batch
from tests.ray_fixtures import ray_session  # noqa: F401

BS = 16
NODES = {"a1": "node-a", "a2": "node-a", "b1": "node-b", "b2": "node-b"}


def test_the_deepest_then_the_cheapest_link_then_the_pullers_node_then_the_name() -> None:
    equal = {"a1": 8, "b1": 8}
    assert nearest_holder(equal, "node-a", NODES) == "a1"  # "b1" would win by name
    assert nearest_holder(equal, "node-b", NODES) == "b1"
    assert nearest_holder(equal, None, NODES) == "b1"  # no node known: by name
    assert nearest_holder({"a1": 7, "b1": 8}, "node-a", NODES) == "b1"  # the deeper first
    # A link measured slow loses to one measured fast, wherever they are.
    links = {"a1": 5e-3, "b1": 1e-4}
    assert nearest_holder(equal, "node-a", NODES, links.__getitem__) == "b1"
    assert nearest_holder({}, "node-a", NODES) is None
    assert nearest_holder({"a1": 0}, "node-a", NODES) is None


def index_where_both_hosts_hold_the_prefix() -> Index:
    idx = Index(FP)
    for w, node in NODES.items():
        meta = {"node": node, "handle": f"handle-{w}", "transport": {}}
        idx.register(w, FP, meta)
    for w in ("a1", "b1"):
        assert idx.apply(batch(w, 0, Stored(tuple(BASE[:8])))).status == "applied"
    return idx


def test_the_router_pulls_from_its_own_host_until_it_measures_otherwise() -> None:
    idx = index_where_both_hosts_hold_the_prefix()
    info = idx.route_lookup(BASE[:8])
    assert info["nodes"] == NODES
    r = Router("kv_aware", BS)
    n = 8
    assert _holder(info, "a2", r, n) == "a1"
    assert _holder(info, "b2", r, n) == "b1"
    # The holders are busy: a2 and b2 pull, each from the holder on its own host.
    views = {
        w: WorkerView(queue=50 if w in ("a1", "b1") else 0, depth=info["held"].get(w, 0), node=node)
        for w, node in NODES.items()
    }
    tokens = n * BS + 5
    r.cost.t_token_s = 1e-3
    c = r.choose(sorted(NODES), views, tokens)
    assert c.worker in ("a2", "b2") and c.pull_blocks == n
    assert (
        r.pick_holder(c.worker, {"a1": n, "b1": n}, info["nodes"])
        == {"a2": "a1", "b2": "b1"}[c.worker]
    )
    # a2 measured its own host's link slower than the other's (a congested host): it goes
    # by what it measured.
    r.learn({"a2": {"samples": {}, "pull_links": {"a1": 5e-3, "b1": 1e-4}}})
    assert _holder(info, "a2", r, n) == "b1"


@pytest.fixture
def loader() -> Iterator[Any]:
    """Makes the connector's loader of a worker of ``NODES`` over a real index (in-process:
    the actor is a lock around the same class); it only looks up here, so no transport."""
    idx = index_where_both_hosts_hold_the_prefix()

    def index_call(method: str, *args: Any) -> Any:
        return getattr(idx, method)(*args)

    config = ClusterConnectorConfig()
    made: list[PullLoader] = []

    def make(worker_id: str) -> PullLoader:
        pl = PullLoader(
            worker_id, config, None, index_call, lambda: False, {}, node=NODES[worker_id]
        )  # type: ignore[arg-type]
        pl.refresh_directory()
        made.append(pl)
        return pl

    yield make
    for pl in made:
        pl.close(5.0)


def test_a_worker_that_looks_up_itself_pulls_from_its_own_host(loader: Any) -> None:
    assert loader("a2")._query(BASE[:8]) == ("a1", 8)
    assert loader("b2")._query(BASE[:8]) == ("b1", 8)
    # The nearest refused or gone: the next one, across the network.
    assert loader("a2")._query(BASE[:8], exclude="a1") == ("b1", 8)


def test_a_holder_that_leaves_a_pin_unanswered_is_passed_over(ray_session: None) -> None:  # noqa: F811
    """A holder whose process hangs (a fault injected on purpose: its pin never answers).
    The first load from it waits out the pin's timeout; the loads after it, queued on the
    same one load thread, must not wait it out again, and a lookup no longer names it."""
    hung = HungHolder.remote()
    idx = Index(FP)
    idx.register("a1", FP, {"node": "node-a", "handle": hung, "transport": {}})
    assert idx.apply(batch("a1", 0, Stored(tuple(BASE[:8])))).status == "applied"

    def index_call(method: str, *args: Any) -> Any:
        return getattr(idx, method)(*args)

    config = ClusterConnectorConfig(timeout_s=0.5)
    transport = SimpleNamespace(add_peer=lambda *_: None)  # never reached: no pin answers
    stats: dict[str, float] = {}
    pl = PullLoader("a2", config, transport, index_call, lambda: False, stats, node="node-a")  # type: ignore[arg-type]
    pl.refresh_directory()
    try:
        assert pl._query(BASE[:8]) == ("a1", 8)

        def load(load_id: int) -> tuple[int, float]:
            started = time.monotonic()
            pl.start_load(load_id, BASE[:8], list(range(8)), PullPlan("a1", 8))
            while not (done := pl.poll_loads()):
                time.sleep(0.01)
            return done[0].num_blocks, time.monotonic() - started

        filled, first_s = load(1)
        assert filled == 0 and first_s >= config.timeout_s
        filled, second_s = load(2)
        assert filled == 0 and second_s < config.timeout_s / 2, second_s
        assert stats["unanswered_pins"] == 1
        assert pl._query(BASE[:8]) == (None, 0)
        assert pl.lookup(BASE[:8], PullPlan("a1", 8)) is None  # a stale plan: it asks the index
    finally:
        pl.close(5.0)
        ray.kill(hung)


@ray.remote
class HungHolder:
    def pin(self, hashes: Any, lease_s: float) -> None:
        time.sleep(60)  # a stopped process answers no pin
