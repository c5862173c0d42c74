"""Losing the index costs routing, never a request: real worker actors, the index killed under them.

A killed index (for good) is replaced by the connectors themselves (``get_index_actor`` by name);
a crashed one restarts empty with a new incarnation. Either way each worker re-registers and
sends a snapshot of its blocks within seconds, its calls never raise meanwhile, and a peer
pulls the blocks again once the index is back.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import ray

from kvmesh import SamplingParams
from kvmesh.connector.index_actor import ACTOR_NAME_PREFIX, get_index_actor
from kvmesh.workers.block_hash import block_hashes
from tests.cluster_helpers import flush, start_workers, stop_workers
from tests.ray_fixtures import actor_pid, ray_session, torch_loaded  # noqa: F401

pytestmark = pytest.mark.usefixtures("ray_session")
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
BS = 4
REJOIN_S = 5.0  # the brief: workers are back in the index within this after it is up again


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def info(worker: Any) -> dict[str, Any]:
    return ray.get(worker.ready.remote())


def seconds_until(cond: Callable[[], bool], timeout_s: float) -> float:
    """Poll ``cond`` (calls that fail count as False) and return the seconds it took."""
    start = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - start
        except ray.exceptions.RayError:
            pass
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.05)


def holds_all(index: Any, blocks: dict[str, set[bytes]]) -> bool:
    """The index lists each worker with exactly its pool's blocks."""
    snap = ray.get(index.snapshot.remote(), timeout=5)
    return all(set(snap.get(w, ())) == held for w, held in blocks.items())


def never_raises_meanwhile(workers: list[Any], rounds: int = 5) -> None:
    """flush and get_stats during the outage answer (a raise here would read as a dead worker)."""
    for _ in range(rounds):
        for w in workers:
            assert isinstance(ray.get(w.flush_events.remote(), timeout=30), int)
            assert isinstance(ray.get(w.connector_stats.remote(), timeout=30), dict)
        time.sleep(0.05)


def setup_blocks(workers: list[Any], seed: int) -> tuple[list[int], dict[str, set[bytes]]]:
    """Run a prompt on the first worker and publish; return it and each worker's blocks."""
    ids = prompt(seed, 41)
    ray.get(workers[0].generate.remote(ids, GREEDY))
    flush(workers)
    blocks = {info(w)["worker_id"]: set(ray.get(w.cached_hashes.remote())) for w in workers}
    assert blocks[info(workers[0])["worker_id"]], "the prompt left blocks behind"
    return ids, blocks


def test_killed_index_is_replaced_and_workers_rejoin() -> None:
    a, b = start_workers(2)
    try:
        fp, a_id, b_id = info(a)["fingerprint"], info(a)["worker_id"], info(b)["worker_id"]
        ids, blocks = setup_blocks([a, b], seed=21)
        old = get_index_actor(fp)
        assert holds_all(old, blocks)
        killed = time.monotonic()
        ray.kill(old)  # for good (no_restart=True): calls on the old handle raise ActorDiedError
        # Requests still run while there is no index (lookups answer 0), and no connector
        # call raises: without the fix flush() raised the index's ActorDiedError.
        other = ray.get(b.generate.remote(prompt(22, 13), GREEDY), timeout=60)
        assert other.metrics.num_pulled_tokens == 0
        never_raises_meanwhile([a, b])
        blocks = {info(w)["worker_id"]: set(ray.get(w.cached_hashes.remote())) for w in (a, b)}

        # Nobody but the connectors creates the new index: find it by name only.
        def replaced_and_rejoined() -> bool:
            index = ray.get_actor(ACTOR_NAME_PREFIX + fp, namespace="kvmesh")
            return index._actor_id != old._actor_id and holds_all(index, blocks)

        seconds_until(replaced_and_rejoined, REJOIN_S - (time.monotonic() - killed))
        new = ray.get_actor(ACTOR_NAME_PREFIX + fp, namespace="kvmesh")
        assert set(ray.get(new.workers.remote())) >= {a_id, b_id}
        # Ray imports a handle's class module where it is deserialized: the workers' handles
        # must not bring torch into the index (that held each rejoin ~3 s: 4.3 s of 5 here).
        assert not torch_loaded(new)
        hashes = block_hashes(ids, BS, info(a)["namespace"])[: (len(ids) - 1) // BS]
        assert ray.get(new.lookup.remote(hashes, b_id)) == {a_id: len(hashes)}
        # A peer finds and pulls the blocks through the new index.
        seconds_until(lambda: ray.get(b.peer_blocks.remote(hashes)) > 0, REJOIN_S)
        out = ray.get(b.generate.remote(ids, GREEDY), timeout=60)
        assert out.metrics.num_pulled_tokens == len(hashes) * BS
        for w in (a, b):
            stats = ray.get(w.connector_stats.remote())
            assert stats["rejoins"] >= 1 and stats["index_errors"] >= 1
    finally:
        stop_workers([a, b])


def test_a_hung_index_stalls_one_lookup_not_each() -> None:
    """The index's process stopped (alive, silent): the first lookup that asks it waits the
    connector's timeout; from then on lookups answer 0 at once (the worker computes) until a
    call of the publisher thread is answered again, and then peers pull through it again."""
    a, b = start_workers(2, timeout_s=2.0)
    try:
        fp = info(a)["fingerprint"]
        pid = actor_pid(get_index_actor(fp))
        seconds = []
        os.kill(pid, signal.SIGSTOP)
        try:
            for seed in range(6):  # prompts no one holds: each one's lookup asks the index
                start = time.monotonic()
                out = ray.get(b.generate.remote(prompt(300 + seed, 41), GREEDY), timeout=60)
                seconds.append(time.monotonic() - start)
                assert out.metrics.num_pulled_tokens == 0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert sum(s > 1.0 for s in seconds) <= 1, seconds
        ids, _ = setup_blocks([a, b], seed=23)
        hashes = block_hashes(ids, BS, info(a)["namespace"])[: (len(ids) - 1) // BS]
        seconds_until(lambda: ray.get(b.peer_blocks.remote(hashes)) > 0, REJOIN_S)
        out = ray.get(b.generate.remote(ids, GREEDY), timeout=60)
        assert out.metrics.num_pulled_tokens == len(hashes) * BS
    finally:
        stop_workers([a, b])


def test_restarted_index_gets_a_new_incarnation_and_workers_rejoin() -> None:
    a, b = start_workers(2)
    try:
        fp, a_id, b_id = info(a)["fingerprint"], info(a)["worker_id"], info(b)["worker_id"]
        ids, blocks = setup_blocks([a, b], seed=23)
        index = get_index_actor(fp)
        first = ray.get(index.incarnation.remote())
        ray.kill(index, no_restart=False)  # a crash: the same actor restarts, empty
        never_raises_meanwhile([a, b])
        seconds_until(lambda: ray.get(index.incarnation.remote(), timeout=5) != first, 30)
        took = seconds_until(lambda: holds_all(index, blocks), REJOIN_S)
        assert get_index_actor(fp)._actor_id == index._actor_id  # restarted, not replaced
        # Rejoined under a new token: the index takes a's batches (and no one else's).
        assert a_id in ray.get(index.workers.remote())
        assert ray.get(index.stats.remote())["unauthorized"] == 0
        hashes = block_hashes(ids, BS, info(a)["namespace"])[: (len(ids) - 1) // BS]
        assert ray.get(index.lookup.remote(hashes, b_id)) == {a_id: len(hashes)}, took
        seconds_until(lambda: ray.get(b.peer_blocks.remote(hashes)) > 0, REJOIN_S)
        out = ray.get(b.generate.remote(ids, GREEDY), timeout=60)
        assert out.metrics.num_pulled_tokens == len(hashes) * BS
    finally:
        stop_workers([a, b])


def test_wait_stored_follows_a_real_worker() -> None:
    (a,) = start_workers(1)
    try:
        fp, a_id = info(a)["fingerprint"], info(a)["worker_id"]
        index = get_index_actor(fp)
        ids = prompt(25, 41)
        hashes = block_hashes(ids, BS, info(a)["namespace"])[: (len(ids) - 1) // BS]
        pending = ray.get(index.add_pending.remote(a_id, hashes, len(ids)))
        waiter = index.wait_stored.remote(a_id, hashes, 60.0)
        assert ray.wait([waiter], timeout=0.5)[0] == []
        ray.get(a.generate.remote(ids, GREEDY))  # no flush: the publisher thread sends it
        assert ray.get(waiter, timeout=10) == len(hashes)
        assert not ray.get(index.drop_pending.remote(pending))  # its Stored dropped it
        # A prompt that never comes: the waiter gives up at its timeout with what is held.
        other = block_hashes(prompt(26, 41), BS, info(a)["namespace"])
        ray.get(index.add_pending.remote(a_id, other, 41))
        start = time.monotonic()
        assert ray.get(index.wait_stored.remote(a_id, other, 1.0), timeout=10) == 0
        assert time.monotonic() - start >= 0.9
    finally:
        stop_workers([a])
