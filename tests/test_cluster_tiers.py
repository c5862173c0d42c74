"""Tiers on real worker actors (Ray, NIXL, the index): the index learns each worker's blocks
per medium, a worker killed and replaced on the same disk announces the blocks it finds there
again, and serves them with the outputs of a worker that computed them; one stopped cleanly
leaves its pool's blocks there too."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import ray

from kvmesh import SamplingParams
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.workers.block_hash import block_hashes
from tests.cluster_helpers import flush, start_workers, stop_workers, wait_until
from tests.ray_fixtures import ray_session  # noqa: F401

pytestmark = pytest.mark.usefixtures("ray_session")
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
BS = 4


def prompt(seed: int, n: int = 41) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def tiers_of(index: Any, hashes: list[bytes], worker_id: str) -> dict[str, int]:
    return ray.get(index.route_lookup.remote(hashes), timeout=10)["tiers"].get(worker_id, {})


def evict(holder: Any, plain: Any, seed: int) -> tuple[dict, Any, list[int], list[bytes], list]:
    """``holder`` computes prompt(seed), then three more that evict it into its tiers;
    (holder's info, the index, the prompt, its block hashes, the no-tier worker's output)."""
    info = ray.get(holder.ready.remote())
    index = get_index_actor(info["fingerprint"])
    ids = prompt(seed)
    hashes = block_hashes(ids, BS, info["namespace"])
    want = ray.get(plain.generate.remote(ids, GREEDY)).token_ids
    ray.get(holder.generate.remote(ids, GREEDY))
    for other in range(seed + 1, seed + 4):
        ray.get(holder.generate.remote(prompt(other), GREEDY))
    return info, index, ids, hashes, want


def test_the_index_knows_disk_blocks_and_a_replacement_announces_them(tmp_path: Path) -> None:
    kw = {"num_kv_blocks": 24, "disk_cache_dir": str(tmp_path), "disk_cache_size": "4MiB"}
    (a,) = start_workers(1, **kw)
    (plain,) = start_workers(1, num_kv_blocks=64)
    replacement = None
    try:
        info, index, ids, hashes, want = evict(a, plain, 1)  # down to disk

        def on_disk(worker: Any, worker_id: str) -> bool:
            flush([worker])
            # Written: in neither the pool nor memory (a block still queued for the disk
            # writer counts as a host block).
            return tiers_of(index, hashes, worker_id) == {
                "device": 0,
                "host": 0,
                "disk": len(hashes),
            }

        assert wait_until(lambda: on_disk(a, info["worker_id"])), tiers_of(
            index, hashes, info["worker_id"]
        )
        ray.kill(a)  # no clean shutdown: what is on disk is what a crash leaves
        (replacement,) = start_workers(1, **kw)
        new_id = ray.get(replacement.ready.remote())["worker_id"]
        assert wait_until(lambda: on_disk(replacement, new_id)), (
            tiers_of(index, hashes, new_id),
            {
                k: v
                for k, v in ray.get(replacement.connector_stats.remote()).items()
                if k in ("disk_scanned_blocks", "disk_blocks", "disk_scan_dropped")
            },
        )
        out = ray.get(replacement.generate.remote(ids, GREEDY))
        assert out.token_ids == want
        assert out.metrics.num_disk_hit_tokens == (len(ids) - 1) // BS * BS
        stats = ray.get(replacement.connector_stats.remote())
        assert stats["disk_scanned_blocks"] >= len(hashes) and stats["disk_corrupt_blocks"] == 0
    finally:
        stop_workers([w for w in (a, plain, replacement) if w is not None])


def test_a_worker_stopped_as_its_replica_stops_it_leaves_its_pool_on_disk(
    tmp_path: Path,
) -> None:
    """Stopped as a replica stops its worker (``shutdown``, then killed), a worker first
    writes the blocks its pool holds to disk: its replacement loads a prompt that never left
    the pool. Before, only evicted blocks reached disk, and the replacement computed it."""
    kw = {"num_kv_blocks": 24, "disk_cache_dir": str(tmp_path), "disk_cache_size": "4MiB"}
    (a,) = start_workers(1, **kw)
    replacement = None
    try:
        ids = prompt(7)
        first = ray.get(a.generate.remote(ids, GREEDY))
        stats = ray.get(a.connector_stats.remote())
        assert stats["disk_blocks"] == 0  # nothing was evicted: all of it is in the pool
        stop_workers([a])
        (replacement,) = start_workers(1, **kw)
        out = ray.get(replacement.generate.remote(ids, GREEDY))
        assert out.token_ids == first.token_ids
        assert out.metrics.num_disk_hit_tokens == (len(ids) - 1) // BS * BS
    finally:
        stop_workers([w for w in (a, replacement) if w is not None])


@pytest.mark.parametrize("medium", ["host", "disk"])
def test_a_peer_pulls_what_a_holder_keeps_in_its_tiers(medium: str, tmp_path: Path) -> None:
    """a's pool evicted the prompt into its host tier, or (without one) onto its disk: b
    still pulls it from a (a promotes the blocks into its pool for the pin, reading disk
    copies off its step thread first), with b's outputs those of a worker that computed it,
    and the index lists the promoted blocks in a's pool again."""
    tier = (
        {"host_cache_memory": "4MiB"}
        if medium == "host"
        else {"disk_cache_dir": str(tmp_path), "disk_cache_size": "4MiB"}
    )
    (a,) = start_workers(1, num_kv_blocks=24, **tier)
    (b,) = start_workers(1, num_kv_blocks=64)
    (plain,) = start_workers(1, num_kv_blocks=64, connector=False)
    try:
        info, index, ids, hashes, want = evict(a, plain, 11)
        n = len(hashes)
        where = {"device": 0, "host": n, "disk": n} if medium == "host" else {"disk": n}

        def in_tier() -> bool:
            flush([a])
            t = tiers_of(index, hashes, info["worker_id"])
            return all(t.get(m, 0) == d for m, d in {"device": 0, "host": 0, **where}.items())

        assert wait_until(in_tier), tiers_of(index, hashes, info["worker_id"])
        out = ray.get(b.generate.remote(ids, GREEDY))
        assert out.token_ids == want
        assert out.metrics.num_pulled_tokens == n * BS
        stats = ray.get(a.connector_stats.remote())
        assert stats["promoted_blocks"] == n and stats["promote_s"] > 0

        def in_pool() -> bool:
            flush([a])
            return ray.get(index.lookup.remote(hashes), timeout=10).get(info["worker_id"]) == n

        assert wait_until(in_pool)
    finally:
        stop_workers([a, b, plain])


def test_a_holder_short_of_room_gives_the_head_it_can_hold() -> None:
    """a keeps the prompt in its host tier while its running requests hold all but 4 of its
    pool's free blocks: b pulls the chain's first 4 blocks (a promotes just those) and
    computes the rest, with a computing worker's outputs. Before, a refused the whole pin and
    b computed everything (a tier soak: 52 of 54 pulls failed so)."""
    (a,) = start_workers(1, num_kv_blocks=24, host_cache_memory="4MiB")
    (b,) = start_workers(1, num_kv_blocks=64)
    (plain,) = start_workers(1, num_kv_blocks=64, connector=False)
    room = 4

    def hold_all_but(self: Any, k: int) -> int:
        """Take free blocks as running requests would (the fault this test injects)."""
        w = self.worker
        self.busy = w.call(lambda: w.kv.pool.get_new_blocks(w.kv.num_free_blocks - k))
        return len(self.busy)

    def give_back(self: Any) -> None:
        self.worker.call(lambda: self.worker.kv.pool.free_blocks(self.busy))

    try:
        info, index, ids, hashes, want = evict(a, plain, 21)

        def in_host() -> bool:
            flush([a])
            return tiers_of(index, hashes, info["worker_id"]).get("host") == len(hashes)

        assert wait_until(in_host), tiers_of(index, hashes, info["worker_id"])
        ray.get(a.__ray_call__.remote(hold_all_but, room))
        assert wait_until(in_host)  # what the blocks taken held went to the host tier too
        out = ray.get(b.generate.remote(ids, GREEDY))
        assert out.token_ids == want
        assert out.metrics.num_pulled_tokens == room * BS
        assert out.metrics.num_computed_tokens == len(ids) - room * BS
        stats = ray.get(b.connector_stats.remote())
        assert stats["pull_failures"] == 0 and stats["pulled_blocks"] == room
        ray.get(a.__ray_call__.remote(give_back))
        assert ray.get(a.num_pinned.remote()) == 0
    finally:
        stop_workers([a, b, plain])
