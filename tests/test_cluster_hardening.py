"""What another Ray driver on the cluster can do to real worker actors and their index: read
no KV without a lease, pin no more than the limits, speak for no worker in the index."""

from __future__ import annotations

import random
import time

import pytest
import ray

from kvmesh import SamplingParams
from kvmesh.connector.events import EventPublisher
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.connector.pending_entries import MAX_PENDING_TTL_S, UNCONFIRMED_TTL_S
from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.peer_leases import MAX_LEASE_S
from tests.cluster_helpers import flush, start_workers, stop_workers
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import wait_for

pytestmark = pytest.mark.usefixtures("ray_session")
BS = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def refused(ref: ray.ObjectRef) -> BaseException:
    """The exception a remote call raised (it must raise)."""
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(ref)
    return e.value.as_instanceof_cause()


def test_another_driver_reads_no_kv_and_pins_within_limits() -> None:
    (a,) = start_workers(1, transport="ray", num_kv_blocks=NUM_BLOCKS)
    try:
        namespace = ray.get(a.ready.remote())["namespace"]
        chains = []
        for seed in (1, 2):  # two requests, 20 blocks each
            ids = prompt(seed, 81)
            ray.get(a.generate.remote(ids, GREEDY))
            chains.append(block_hashes(ids, BS, namespace)[:20])
        # No lease, a guessed one, the old counter ids: no bytes.
        for args in [(0, [0, 1]), ("0" * 32, [0, 1]), (None, [0])]:
            assert isinstance(refused(a.export_blocks.remote(*args)), PermissionError)
        lease, ids = ray.get(a.pin.remote(chains[0][:8], 5.0))
        assert isinstance(lease, str) and len(lease) >= 32
        assert ray.get(a.export_blocks.remote(lease, ids)).nbytes > 0
        other = set(range(NUM_BLOCKS)) - set(ids)  # blocks not under this lease
        assert isinstance(refused(a.export_blocks.remote(lease, [min(other)])), PermissionError)
        ray.get(a.release.remote(lease))
        assert isinstance(refused(a.export_blocks.remote(lease, ids)), PermissionError)
        # Leases: no longer than MAX_LEASE_S, finite, positive.
        for lease_s in (1e9, MAX_LEASE_S * 2, float("inf"), float("nan"), 0.0, -5.0):
            assert ray.get(a.pin.remote(chains[0], lease_s)) is None
        # Blocks: at most half the pool pinned, however many calls; a pin past it holds the
        # head that fits.
        greedy = ray.get(a.pin.remote(chains[0] + chains[1], MAX_LEASE_S))  # 40 asked
        assert len(greedy[1]) == NUM_BLOCKS // 2
        ray.get(a.release.remote(greedy[0]))
        leases = [ray.get(a.pin.remote(c, MAX_LEASE_S)) for c in chains]
        assert [len(ids) for _, ids in leases] == [20, 12]  # 32: the cap
        assert ray.get(a.pin.remote(chains[1][12:], MAX_LEASE_S)) is None  # none more
        assert ray.get(a.num_pinned.remote()) == NUM_BLOCKS // 2
        assert ray.get(a.occupancy.remote())["free_blocks"] >= NUM_BLOCKS // 2
        # The worker still serves its own requests meanwhile.
        out = ray.get(a.generate.remote(prompt(3, 60), GREEDY), timeout=60)
        assert len(out.token_ids) == 2
    finally:
        stop_workers([a])


def test_another_driver_cannot_speak_for_a_worker_in_the_index() -> None:
    a, b = start_workers(2, transport="ray")
    try:
        info = ray.get(a.ready.remote())
        a_id, fp = info["worker_id"], info["fingerprint"]
        ids = prompt(4, 41)
        ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        index = get_index_actor(fp)
        hashes = block_hashes(ids, BS, info["namespace"])[:10]
        assert ray.get(index.lookup.remote(hashes)) == {a_id: 10}
        forged = EventPublisher(a_id)
        forged.on_clear()
        forged_batch = forged.drain()
        for _ in range(3):  # whatever seq a's publisher is at: never applied without a token
            forged.on_clear()
            assert ray.get(index.apply.remote(forged.drain(), None)) == "rejected"
        assert ray.get(index.apply.remote(forged_batch, "0" * 32)) == "rejected"
        assert isinstance(refused(index.deregister.remote(a_id, None)), PermissionError)
        assert isinstance(
            refused(index.register.remote(a_id, fp, {"transport": b"evil"})), PermissionError
        )
        assert ray.get(index.lookup.remote(hashes)) == {a_id: 10}
        # A forged pending entry ("a computes this prompt now") is believed only briefly:
        # no other caller can confirm it, and a refuses one for a prompt it was not sent.
        other = block_hashes(prompt(5, 41), BS, info["namespace"])[:10]
        pid = ray.get(index.add_pending.remote(a_id, other, 40, MAX_PENDING_TTL_S))
        lives = ray.get(index.pending.remote())[pid]["expires"] - time.monotonic()
        assert 0 < lives <= UNCONFIRMED_TTL_S
        forged_confirm = index.confirm_pending.remote(a_id, pid, other, "0" * 32)
        assert isinstance(refused(forged_confirm), PermissionError)
        # The index may be shared with earlier tests' workers (same model): count from here.
        confirmed = ray.get(index.stats.remote())["pending_confirmed"]
        assert ray.get(a.confirm_pending.remote(pid, ids))  # sent, with a's own hashes...
        assert ray.get(index.stats.remote())["pending_confirmed"] == confirmed  # ...refused
        assert ray.get(a.confirm_pending.remote(pid, prompt(5, 41)))  # the prompt it claims
        wait_for(
            lambda: ray.get(index.stats.remote())["pending_confirmed"] == confirmed + 1, 10, "it"
        )
        assert ray.get(index.pending.remote())[pid]["expires"] - time.monotonic() > lives
        assert ray.get(index.drop_pending.remote(pid))
        # a's own connector still publishes, and b still pulls from it.
        out = ray.get(b.generate.remote(ids, GREEDY), timeout=60)
        assert out.metrics.num_pulled_tokens == 40
        assert ray.get(index.stats.remote())["unauthorized"] >= 6
    finally:
        stop_workers([a, b])


def test_a_prefix_longer_than_the_holders_pin_cap_is_pulled_up_to_it() -> None:
    a, b = start_workers(2, transport="ray", num_kv_blocks=16)  # peers may pin 8 blocks of a's
    try:
        ids = prompt(5, 41)  # 10 full blocks before the last token
        ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        out = ray.get(b.generate.remote(ids, GREEDY), timeout=60)
        assert out.metrics.num_pulled_tokens == 8 * BS  # not refused whole: 8 pulled
        assert out.metrics.num_computed_tokens == len(ids) - 8 * BS
        assert ray.get(b.connector_stats.remote())["pull_failures"] == 0
    finally:
        stop_workers([a, b])
