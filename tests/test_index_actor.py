"""KvIndexActor on a real local Ray: one named actor per fingerprint, events, liveness purges."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import ray

from kvmesh.connector.events import EventPublisher
from kvmesh.connector.index_actor import get_index_actor
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.test_kv_index import BASE, FORK4

pytestmark = pytest.mark.usefixtures("ray_session")


@ray.remote(num_cpus=0)
class DummyWorker:
    """Stands in for a worker actor: something alive whose handle the index can watch."""

    def ping(self) -> str:
        return "pong"


@pytest.fixture
def fingerprint() -> str:
    """A fresh fingerprint id per test, so tests never share an index actor."""
    return uuid.uuid4().hex[:16]


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> float:
    """Poll until ``cond()``; return the seconds it took."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout_s, "condition not met in time"
        time.sleep(0.05)
    return time.monotonic() - start


def test_named_actor_is_one_per_fingerprint(fingerprint: str) -> None:
    a = get_index_actor(fingerprint)
    b = get_index_actor(fingerprint)
    other = get_index_actor(fingerprint + "x")
    ray.get(a.register.remote("w0", fingerprint))
    assert ray.get(b.workers.remote()) == {"w0": {}}
    assert ray.get(other.workers.remote()) == {}
    assert ray.get(a.__ray_ready__.remote())
    assert a._actor_id == b._actor_id != other._actor_id
    with pytest.raises(ValueError, match=fingerprint):
        ray.get(a.register.remote("w1", "some-other-model"))
    ray.kill(a)
    ray.kill(other)


def test_events_and_lookups_through_the_actor(fingerprint: str) -> None:
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None)
    for w in ("a", "b"):
        ray.get(index.register.remote(w, fingerprint, {"node": w}))
    pa, pb = EventPublisher("a"), EventPublisher("b")
    pa.on_store(BASE[:6], None)
    pb.on_store(FORK4[:8], None)
    assert ray.get(index.apply.remote(pa.drain())) == "applied"
    assert ray.get(index.apply.remote(pb.drain())) == "applied"
    assert ray.get(index.lookup.remote(BASE)) == {"a": 6, "b": 4}
    assert ray.get(index.lookup.remote(BASE, "a")) == {"b": 4}
    pa.on_remove(BASE[3:6])
    first = pa.drain()
    pa.on_store(BASE[3:4], BASE[2])
    statuses = ray.get(index.apply_many.remote([first, pa.drain(), first, b"junk"]))
    assert statuses == ["applied", "applied", "duplicate", "rejected"]
    pa.on_clear()
    pa.drain()  # lost on the way
    pa.on_store(BASE[:1], None)
    assert ray.get(index.apply.remote(pa.drain())) == "gap"
    assert ray.get(index.needs_snapshot.remote("a"))
    ray.get(index.apply_snapshot.remote("a", BASE[:2], pa.reset_for_snapshot()))
    assert ray.get(index.lookup.remote(BASE)) == {"a": 2, "b": 4}
    assert ray.get(index.snapshot.remote())["a"] == sorted(BASE[:2])
    stats = ray.get(index.stats.remote())
    assert (stats["batches_applied"], stats["duplicates"], stats["gaps"]) == (4, 1, 1)
    assert stats["batches_rejected"] == 1 and stats["workers"] == 2
    assert ray.get(index.deregister.remote("b")) and ray.get(index.lookup.remote(BASE)) == {"a": 2}
    ray.kill(index)


def test_killed_worker_actor_is_purged(fingerprint: str) -> None:
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None, check_interval_s=0.1)
    alive, doomed = DummyWorker.remote(), DummyWorker.remote()
    ray.get([alive.ping.remote(), doomed.ping.remote()])
    ray.get(index.register.remote("alive", fingerprint, None, alive))
    ray.get(index.register.remote("doomed", fingerprint, None, doomed))
    pub = EventPublisher("doomed")
    pub.on_store(BASE[:4], None)
    ray.get(index.apply.remote(pub.drain()))
    time.sleep(0.5)  # a few liveness rounds with both alive: nobody is purged
    assert set(ray.get(index.workers.remote())) == {"alive", "doomed"}
    ray.kill(doomed)
    took = wait_for(lambda: set(ray.get(index.workers.remote())) == {"alive"})
    assert took < 5.0
    assert ray.get(index.lookup.remote(BASE)) == {}
    assert ray.get(index.stats.remote())["purged_dead"] == 1
    ray.kill(alive)
    ray.kill(index)


def test_worker_that_stops_heartbeating_is_purged(fingerprint: str) -> None:
    index = get_index_actor(fingerprint, heartbeat_timeout_s=1.0, check_interval_s=0.1)
    ray.get(index.register.remote("steady", fingerprint))
    ray.get(index.register.remote("silent", fingerprint))
    start = time.monotonic()
    while time.monotonic() - start < 2.0:  # `steady` beats, `silent` does not
        assert ray.get(index.heartbeat.remote("steady"))
        time.sleep(0.1)
    assert set(ray.get(index.workers.remote())) == {"steady"}
    assert not ray.get(index.heartbeat.remote("silent"))  # told to re-register
    assert ray.get(index.stats.remote())["purged_stale"] == 1
    ray.kill(index)
