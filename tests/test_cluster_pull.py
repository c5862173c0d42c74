"""Peer block pulls through the cluster connector: real Ray actors, real NIXL, real index."""

from __future__ import annotations

import random

import pytest
import ray

from kvmesh import LLM, SamplingParams
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.workers.block_hash import block_hashes
from tests.cluster_helpers import flush, start_workers, stop_workers, wait_until
from tests.ray_fixtures import ray_session  # noqa: F401

pytestmark = pytest.mark.usefixtures("ray_session")
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=5)
BS = 4


@pytest.fixture(scope="module")
def reference() -> LLM:
    """tiny-random computed from scratch in this process, no connector."""
    return LLM("tiny-random", block_size=BS, num_kv_blocks=256, progress=False)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def index_of(worker) -> ray.actor.ActorHandle:
    return get_index_actor(ray.get(worker.ready.remote())["fingerprint"])


def assert_same(out, ref) -> None:
    """Same greedy tokens, same top-5 logprobs up to float summation order (the pulled run
    computes a few suffix tokens against cached KV, the reference the whole prompt at once)."""
    assert out.token_ids == ref.token_ids
    for ours, theirs in zip(out.logprobs, ref.logprobs, strict=True):
        assert ours.keys() == theirs.keys()
        for tok, lp in ours.items():
            assert abs(lp - theirs[tok]) < 1e-4, (tok, lp, theirs[tok])


def block_bytes(worker, hashes: list[bytes]) -> bytes:
    lease_id, ids = ray.get(worker.pin.remote(hashes, 10.0))
    try:
        return ray.get(worker.export_blocks.remote(lease_id, ids)).tobytes()
    finally:
        ray.get(worker.release.remote(lease_id))


@pytest.mark.parametrize("transport", ["nixl", "ray"])
def test_second_worker_pulls_the_whole_prefix(transport: str, reference: LLM) -> None:
    a, b = start_workers(2, transport=transport)
    try:
        ids = prompt(1, 61)
        first = ray.get(a.generate.remote(ids, GREEDY))
        assert first.metrics.num_pulled_tokens == 0
        flush([a])
        second = ray.get(b.generate.remote(ids, GREEDY))
        full_blocks = (len(ids) - 1) // BS * BS  # the last token is always computed
        assert second.metrics.num_pulled_tokens == full_blocks
        assert second.metrics.num_local_hit_tokens == 0
        assert second.metrics.num_computed_tokens == len(ids) - full_blocks
        assert_same(second, reference.generate([ids], GREEDY)[0])
        # The pulled blocks hold exactly the holder's bytes.
        namespace = ray.get(a.ready.remote())["namespace"]
        hashes = block_hashes(ids, BS, namespace)[: full_blocks // BS]
        assert block_bytes(a, hashes) == block_bytes(b, hashes)
        stats = ray.get(b.connector_stats.remote())
        assert stats["pulls"] == 1 and stats["pulled_bytes"] > 0
        assert ray.get(a.num_leases.remote()) == 0  # the lease was released
    finally:
        stop_workers([a, b])


def test_a_16_bit_cache_pulls_half_the_bytes_and_only_from_its_kind(reference: LLM) -> None:
    # bfloat16 workers (a float32 model) pull each other's blocks over NIXL: half the bytes
    # of float32 blocks, the holder's bytes exactly, the answer the holder's own. A float32
    # worker of the same model never sees them (another fingerprint, another index).
    a, b = start_workers(2, kv_cache_dtype="bfloat16")
    (c,) = start_workers(1)
    try:
        ids = prompt(5, 61)
        first = ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        second = ray.get(b.generate.remote(ids, GREEDY))
        full_blocks = (len(ids) - 1) // BS * BS
        assert second.metrics.num_pulled_tokens == full_blocks
        assert_same(second, first)
        namespace = ray.get(a.ready.remote())["namespace"]
        hashes = block_hashes(ids, BS, namespace)[: full_blocks // BS]
        assert block_bytes(a, hashes) == block_bytes(b, hashes)
        half = ray.get(b.connector_stats.remote())["pulled_bytes"]
        third = ray.get(c.generate.remote(ids, GREEDY))
        assert third.metrics.num_pulled_tokens == 0
        flush([c])
        (d,) = start_workers(1)  # pulls them from c, as float32
        try:
            assert ray.get(d.generate.remote(ids, GREEDY)).metrics.num_pulled_tokens == full_blocks
            assert ray.get(d.connector_stats.remote())["pulled_bytes"] == 2 * half
        finally:
            stop_workers([d])
    finally:
        stop_workers([a, b, c])


def test_index_equals_union_of_pools_after_evictions(reference: LLM) -> None:
    workers = start_workers(3, num_kv_blocks=24)
    try:
        rng = random.Random(2)
        bases = [prompt(100 + i, 30) for i in range(4)]
        refs = []
        for _ in range(24):
            ids = rng.choice(bases)[: rng.randrange(5, 30)] + prompt(rng.randrange(10**6), 6)
            w = rng.choice(workers)
            refs.append(w.generate.remote(ids, SamplingParams(max_tokens=3, temperature=0)))
        ray.get(refs)
        flush(workers)
        pools = {
            ray.get(w.ready.remote())["worker_id"]: set(ray.get(w.cached_hashes.remote()))
            for w in workers
        }
        snapshot = ray.get(index_of(workers[0]).snapshot.remote())
        assert {k: set(v) for k, v in snapshot.items() if k in pools} == pools
        assert sum(len(v) for v in pools.values()) > 0
    finally:
        stop_workers(workers)


def test_dead_holder_means_compute_and_leaves_the_index(reference: LLM) -> None:
    a, b = start_workers(2)
    a_id = ray.get(a.ready.remote())["worker_id"]
    index = index_of(a)
    try:
        ids = prompt(3, 57)
        ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        ray.kill(a)  # the index still lists a's blocks: b's pull must fail and compute
        out = ray.get(b.generate.remote(ids, GREEDY))
        assert_same(out, reference.generate([ids], GREEDY)[0])
        assert wait_until(lambda: a_id not in ray.get(index.workers.remote()))
        assert a_id not in ray.get(index.snapshot.remote())
    finally:
        stop_workers([b])


def test_holder_killed_mid_pull_still_answers_correctly(reference: LLM) -> None:
    a, b = start_workers(2)
    try:
        ids = prompt(4, 61)
        ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        pending = b.generate.remote(ids, GREEDY)
        ray.kill(a)
        assert_same(ray.get(pending, timeout=60), reference.generate([ids], GREEDY)[0])
    finally:
        stop_workers([b])


def test_eviction_race_never_yields_wrong_tokens(reference: LLM) -> None:
    workers = start_workers(3, num_kv_blocks=20, max_num_batched_tokens=16)
    try:
        rng = random.Random(5)
        bases = [prompt(200 + i, 40) for i in range(3)]
        jobs = []
        for _ in range(6):  # rounds of concurrent requests over shared prefixes
            batch = []
            for w in workers:
                ids = rng.choice(bases)[: rng.randrange(12, 40)] + prompt(rng.randrange(10**6), 3)
                batch.append((ids, w.generate.remote(ids, GREEDY)))
            jobs.extend((ids, ray.get(ref, timeout=120)) for ids, ref in batch)
        pulled = sum(out.metrics.num_pulled_tokens for _, out in jobs)
        want = reference.generate([ids for ids, _ in jobs], GREEDY)
        for (_, out), ref in zip(jobs, want, strict=True):
            assert_same(out, ref)
        assert pulled > 0, "the workload was meant to pull"
    finally:
        stop_workers(workers)


def test_other_fingerprint_is_never_used() -> None:
    (a,) = start_workers(1)
    (c,) = start_workers(1, block_size=8)  # another cache layout: another fingerprint
    try:
        assert ray.get(a.ready.remote())["fingerprint"] != ray.get(c.ready.remote())["fingerprint"]
        ids = prompt(6, 64)
        ray.get(a.generate.remote(ids, GREEDY))
        flush([a])
        out = ray.get(c.generate.remote(ids, GREEDY))
        assert out.metrics.num_pulled_tokens == 0
    finally:
        stop_workers([a, c])


def test_streaming_from_the_actor() -> None:
    (a,) = start_workers(1)
    try:
        params = SamplingParams(max_tokens=6, temperature=0)
        deltas = [ray.get(r) for r in a.generate_stream.remote(prompt(7, 9), params)]
        assert deltas[-1].finish_reason == "length"
        assert [t for d in deltas for t in d.token_ids] == deltas[-1].output.token_ids
    finally:
        stop_workers([a])


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_pull_equals_compute(smollm2_llm) -> None:
    a, b = start_workers(
        2, model="smollm2-135m", block_size=16, num_kv_blocks=None, kv_cache_memory="64MiB"
    )
    try:
        ids = smollm2_llm.chat_prompt(
            [{"role": "user", "content": "Explain paged attention in one paragraph. " * 4}]
        )
        params = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
        ray.get(a.generate.remote(ids, params))
        flush([a])
        out = ray.get(b.generate.remote(ids, params))
        assert out.metrics.num_pulled_tokens == (len(ids) - 1) // 16 * 16
        assert_same(out, smollm2_llm.generate([ids], params)[0])
    finally:
        stop_workers([a, b])
