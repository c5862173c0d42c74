"""KvIndexActor on a real local Ray: one named actor per fingerprint, events, liveness purges."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

import pytest
import ray
from ray.exceptions import RayActorError

from kvmesh.connector.events import EventPublisher
from kvmesh.connector.index_actor import get_index_actor
from tests.kv_index_helpers import BASE, FORK4, FORK8
from tests.ray_fixtures import actor_pid, ray_session  # noqa: F401

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
    tokens = {w: ray.get(index.register.remote(w, fingerprint, {"node": w}))[1] for w in "ab"}
    pa, pb = EventPublisher("a"), EventPublisher("b")
    pa.on_store(BASE[:6], None)
    pb.on_store(FORK4[:8], None)
    assert ray.get(index.apply.remote(pa.drain(), tokens["a"])) == "applied"
    assert ray.get(index.apply.remote(pb.drain(), tokens["b"])) == "applied"
    assert ray.get(index.lookup.remote(BASE)) == {"a": 6, "b": 4}
    assert ray.get(index.lookup.remote(BASE, "a")) == {"b": 4}
    pa.on_remove(BASE[3:6])
    first = pa.drain()
    pa.on_store(BASE[3:4], BASE[2])
    statuses = ray.get(index.apply_many.remote([first, pa.drain(), first, b"junk"], tokens))
    assert statuses == ["applied", "applied", "duplicate", "rejected"]
    pa.on_clear()
    pa.drain()  # lost on the way
    pa.on_store(BASE[:1], None)
    assert ray.get(index.apply.remote(pa.drain(), tokens["a"])) == "gap"
    assert ray.get(index.needs_snapshot.remote("a"))
    ray.get(index.apply_snapshot.remote("a", BASE[:2], pa.reset_for_snapshot(), tokens["a"]))
    assert ray.get(index.lookup.remote(BASE)) == {"a": 2, "b": 4}
    assert ray.get(index.snapshot.remote())["a"] == sorted(BASE[:2])
    stats = ray.get(index.stats.remote())
    assert (stats["batches_applied"], stats["duplicates"], stats["gaps"]) == (4, 1, 1)
    assert stats["batches_rejected"] == 1 and stats["workers"] == 2
    assert ray.get(index.deregister.remote("b", tokens["b"]))
    assert ray.get(index.lookup.remote(BASE)) == {"a": 2}
    ray.kill(index)


def test_tiers_through_the_actor(fingerprint: str) -> None:
    """Media travel through the actor: ``route_lookup`` carries ``tiers``, ``apply_snapshot``
    takes them (positionally too, as the connector passes them)."""
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None)
    _, token = ray.get(index.register.remote("a", fingerprint))
    pub = EventPublisher("a")
    pub.on_store(BASE[:4], None)
    pub.on_remove(BASE[2:4])  # evicted from the pool into the host tier
    pub.on_store(BASE[2:4], BASE[1], "host")
    assert ray.get(index.apply.remote(pub.drain(), token)) == "applied"
    got = ray.get(index.route_lookup.remote(BASE))
    assert got["held"] == {"a": 2}
    assert got["tiers"] == {"a": {"device": 2, "host": 4, "disk": 4}}
    seq = pub.reset_for_snapshot()
    ray.get(index.apply_snapshot.remote("a", BASE[:1], seq, token, {"disk": BASE[1:6]}))
    got = ray.get(index.route_lookup.remote(BASE))
    assert got["tiers"] == {"a": {"device": 1, "host": 1, "disk": 6}}
    stats = ray.get(index.stats.remote())
    assert (stats["entries"], stats["host_entries"], stats["disk_entries"]) == (1, 0, 5)
    with pytest.raises(ValueError, match="tiers"):
        ray.get(index.apply_snapshot.remote("a", [], seq, token, tiers={"gpu": []}))
    ray.get(index.apply_snapshot.remote("a", BASE[:1], seq, token))  # no tiers: emptied
    assert ray.get(index.route_lookup.remote(BASE))["tiers"] == {}
    ray.kill(index)


def test_killed_worker_actor_is_purged(fingerprint: str) -> None:
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None, check_interval_s=0.1)
    alive, doomed = DummyWorker.remote(), DummyWorker.remote()
    ray.get([alive.ping.remote(), doomed.ping.remote()])
    ray.get(index.register.remote("alive", fingerprint, None, alive))
    _, token = ray.get(index.register.remote("doomed", fingerprint, None, doomed))
    pub = EventPublisher("doomed")
    pub.on_store(BASE[:4], None)
    assert ray.get(index.apply.remote(pub.drain(), token)) == "applied"
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
    _, token = ray.get(index.register.remote("steady", fingerprint))
    _, silent = ray.get(index.register.remote("silent", fingerprint))
    start = time.monotonic()
    while time.monotonic() - start < 2.0:  # `steady` beats, `silent` does not
        assert ray.get(index.heartbeat.remote("steady", token))
        time.sleep(0.1)
    assert set(ray.get(index.workers.remote())) == {"steady"}
    assert not ray.get(index.heartbeat.remote("silent", silent))  # told to re-register
    assert ray.get(index.stats.remote())["purged_stale"] == 1
    ray.kill(index)


def test_a_paused_index_does_not_blame_its_workers(fingerprint: str) -> None:
    """The index's process stopped (SIGSTOP) for longer than the heartbeat timeout, while its
    workers could not reach it: once it runs again it keeps them (the pause was its own),
    and still purges a worker that stays silent after it."""
    index = get_index_actor(fingerprint, heartbeat_timeout_s=1.0, check_interval_s=0.1)
    pid = actor_pid(index)
    _, token = ray.get(index.register.remote("steady", fingerprint))
    ray.get(index.register.remote("silent", fingerprint))
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)
    finally:
        os.kill(pid, signal.SIGCONT)
    start = time.monotonic()
    while time.monotonic() - start < 2.0:  # `steady` beats again, `silent` does not
        assert ray.get(index.heartbeat.remote("steady", token)), "steady was purged"
        time.sleep(0.1)
    assert set(ray.get(index.workers.remote())) == {"steady"}
    assert ray.get(index.stats.remote())["purged_stale"] == 1
    ray.kill(index)


def ray_get_retrying(ref_fn: Callable[[], ray.ObjectRef], timeout_s: float = 10.0):
    """ray.get(ref_fn()), retried while the actor restarts (ActorUnavailableError and kin)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(ref_fn(), timeout=timeout_s)
        except RayActorError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_incarnation_and_restart_empty(fingerprint: str) -> None:
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None)
    first = ray.get(index.incarnation.remote())
    assert isinstance(first, str) and len(first) == 32
    incarnation, token = ray.get(index.register.remote("w", fingerprint))
    assert incarnation == first
    assert ray.get(index.heartbeat.remote("w", token)) == first
    assert ray.get(index.heartbeat.remote("ghost", None)) is None
    pid = ray.get(index.add_pending.remote("w", BASE[:4], 16))
    got = ray.get(index.route_lookup.remote(BASE))
    assert got == {
        "incarnation": first,
        "held": {},
        "tiers": {},
        "pending": {"w": {"depth": 4, "wait_tokens": 16}},
        "backlog": {"w": 16},
        "queued": {"w": 1},
        "last_pending_id": pid,
        "nodes": {"w": None},  # registered without a node
    }
    assert ray.get(index.drop_pending.remote(pid)) and not ray.get(index.drop_pending.remote(pid))
    ray.kill(index, no_restart=False)  # a crash: restarted under the same name, empty
    # ray.kill returns at once: the old process may still answer a call or two.
    wait_for(lambda: ray_get_retrying(lambda: index.incarnation.remote()) != first)
    second = ray.get(index.incarnation.remote())
    assert ray.get(index.heartbeat.remote("w", token)) is None  # the worker must re-register
    assert ray.get(index.workers.remote()) == {}
    assert get_index_actor(fingerprint)._actor_id == index._actor_id
    ray.kill(index)  # for good: the name is free, the next get_index_actor makes a new one
    third = get_index_actor(fingerprint)
    assert third._actor_id != index._actor_id
    assert ray_get_retrying(lambda: third.incarnation.remote()) not in (first, second)
    ray.kill(third)


def test_wait_stored_returns_on_store_drop_expiry_and_timeout(fingerprint: str) -> None:
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None)
    _, token = ray.get(index.register.remote("w", fingerprint))
    pub = EventPublisher("w")
    pending = ray.get(index.add_pending.remote("w", BASE[:6], 24))
    waiters = [index.wait_stored.remote("w", BASE[:6], 30.0) for _ in range(20)]
    assert ray.wait(waiters, timeout=0.3)[0] == []
    pub.on_store(BASE[:3], None)  # half of it: still waiting
    assert ray.get(index.apply.remote(pub.drain(), token)) == "applied"
    assert ray.wait(waiters, timeout=0.3)[0] == []
    pub.on_store(BASE[3:6], BASE[2])
    start = time.monotonic()
    assert ray.get(index.apply.remote(pub.drain(), token)) == "applied"
    assert ray.get(waiters, timeout=5) == [6] * 20  # all twenty woken by the one store
    assert time.monotonic() - start < 2.0
    assert not ray.get(index.drop_pending.remote(pending))  # the Stored dropped it
    # Dropped (the prompt failed): the waiter gets what the worker holds, FORK4's first 4.
    pending = ray.get(index.add_pending.remote("w", FORK4, 48))
    waiter = index.wait_stored.remote("w", FORK4, 30.0)
    assert ray.wait([waiter], timeout=0.3)[0] == []
    assert ray.get(index.drop_pending.remote(pending))
    assert ray.get(waiter, timeout=5) == 4
    # Expired: same, without anyone dropping it.
    ray.get(index.add_pending.remote("w", FORK8, 48, 0.5))
    start = time.monotonic()
    assert ray.get(index.wait_stored.remote("w", FORK8, 30.0), timeout=10) == 6
    assert 0.4 < time.monotonic() - start < 5.0
    # Timed out while the entry still stands.
    pending = ray.get(index.add_pending.remote("w", FORK8, 48))
    start = time.monotonic()
    assert ray.get(index.wait_stored.remote("w", FORK8, 0.5), timeout=10) == 6
    assert 0.45 < time.monotonic() - start < 5.0
    assert ray.get(index.drop_pending.remote(pending))
    # Nothing pending, or all held: at once.
    start = time.monotonic()
    assert ray.get(index.wait_stored.remote("w", BASE, 30.0)) == 6
    assert ray.get(index.wait_stored.remote("w", BASE[:2], 30.0)) == 2
    assert ray.get(index.wait_stored.remote("ghost", BASE, 30.0)) == 0
    assert time.monotonic() - start < 2.0
    ray.kill(index)


def test_waiters_hold_no_thread_and_a_purge_wakes_them(fingerprint: str) -> None:
    # 300 waiters at once, more than the 256 threads the threaded actor had (Ray started
    # them all with the actor, each waiter holding one): the asynchronous actor keeps them
    # on its event loop, in a process of a few dozen threads, and the liveness thread's purge
    # of the worker they wait for (its actor killed) wakes every one.
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None, check_interval_s=0.1)
    doomed = DummyWorker.remote()
    ray.get(doomed.ping.remote())
    ray.get(index.register.remote("doomed", fingerprint, None, doomed))
    ray.get(index.add_pending.remote("doomed", BASE[:6], 24))
    waiters = [index.wait_stored.remote("doomed", BASE[:6], 60.0) for _ in range(300)]
    assert ray.wait(waiters, timeout=0.5)[0] == []
    assert len(os.listdir(f"/proc/{actor_pid(index)}/task")) < 64
    assert ray.get(index.lookup.remote(BASE)) == {}  # answered while they wait
    ray.kill(doomed)
    start = time.monotonic()
    assert ray.get(waiters, timeout=15) == [0] * 300
    assert time.monotonic() - start < 5.0
    ray.kill(index)


def test_calls_for_a_worker_need_its_token(fingerprint: str) -> None:
    """A second driver cannot feed, snapshot, heartbeat, deregister or take over a worker."""
    index = get_index_actor(fingerprint, heartbeat_timeout_s=None)
    incarnation, token = ray.get(index.register.remote("w", fingerprint, {"node": "n1"}))
    assert len(token) >= 32 and token != incarnation
    assert token not in repr(ray.get(index.workers.remote()))
    forged = EventPublisher("w")
    forged.on_store(BASE[:6], None)
    data = forged.drain()
    assert ray.get(index.apply.remote(data, None)) == "rejected"
    assert ray.get(index.apply_many.remote([data], "0" * 32)) == ["rejected"]
    assert ray.get(index.lookup.remote(BASE)) == {}
    for call in (
        lambda: index.apply_snapshot.remote("w", BASE, 9, "forged"),
        lambda: index.heartbeat.remote("w", None),
        lambda: index.deregister.remote("w", "forged"),
        lambda: index.register.remote("w", fingerprint, {"node": "evil"}),
    ):
        with pytest.raises(ray.exceptions.RayTaskError) as e:
            ray.get(call())
        assert isinstance(e.value.as_instanceof_cause(), PermissionError)
    assert ray.get(index.workers.remote()) == {"w": {"node": "n1"}}
    assert ray.get(index.stats.remote())["unauthorized"] == 6
    assert ray.get(index.apply.remote(data, token)) == "applied"  # the worker itself
    assert ray.get(index.lookup.remote(BASE)) == {"w": 6}
    assert ray.get(index.deregister.remote("w", token))
    ray.kill(index)
