"""Exact block ids and eviction order, in the style of vLLM's test_prefix_caching."""

import pytest

from kvmesh.workers.kv_allocation import RequestTooLargeError
from tests.kv_harness import KvHarness


def make(num_blocks: int = 10, block_size: int = 4) -> KvHarness:
    return KvHarness(num_blocks, block_size)


def ids(h: KvHarness, rid: str) -> list[int]:
    return h.manager.get_block_ids(h.requests[rid])


def test_shared_prefix_hits_and_free_order() -> None:
    h = make()
    r0 = h.new_request("r0", list(range(10)))  # 2 full blocks + 2 tokens
    a0 = h.prefill(r0)
    assert a0 is not None and a0.num_kv_tokens == 0
    assert ids(h, "r0") == [0, 1, 2]
    assert sorted(h.manager.pool.cached.values(), key=lambda b: b.block_id)[0].block_id == 0
    assert len(h.manager.pool.cached) == 2  # blocks 0 and 1; block 2 is partial

    r1 = h.new_request("r1", [*range(8), 100, 101, 102])
    a1 = h.prefill(r1)
    assert a1 is not None and a1.num_local_hit_tokens == 8
    assert ids(h, "r1") == [0, 1, 3]
    assert [b.block_id for b in a1.new_blocks] == [3]
    assert [b.ref_cnt for b in h.manager.pool.blocks[:4]] == [2, 2, 1, 1]

    h.finish(r0)  # freed tail first: only block 2 reaches ref 0
    assert h.manager.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2]
    h.finish(r1)
    assert h.manager.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    h.manager.check_integrity()


def test_divergence_mid_block_hits_only_whole_blocks() -> None:
    h = make()
    h.prefill(h.new_request("r0", list(range(12))))
    r1 = h.new_request("r1", [0, 1, 2, 3, 4, 5, 99, 7, 8, 9, 10, 11])
    alloc = h.prefill(r1)
    assert alloc is not None and alloc.num_local_hit_tokens == 4
    assert ids(h, "r1") == [0, 3, 4]
    h.check_kv()


def test_full_block_hit_leaves_last_token_to_compute() -> None:
    h = make()
    h.prefill(h.new_request("r0", list(range(8))))  # exactly 2 full blocks
    assert len(h.manager.pool.cached) == 2
    r1 = h.new_request("r1", list(range(8)))
    computed = h.manager.get_computed_blocks(r1)
    # (8 - 1) // 4 = 1: block 1 is cached but its last token must run to produce logits.
    assert [b.block_id for b in computed.local_blocks] == [0]
    alloc = h.manager.allocate_slots(r1, 4, computed)
    assert alloc is not None and [b.block_id for b in alloc.new_blocks] == [2]
    r2 = h.new_request("r2", list(range(9)))
    assert [b.block_id for b in h.manager.get_computed_blocks(r2).local_blocks] == [0, 1]


def test_touch_of_free_cached_block_takes_it_off_the_queue() -> None:
    h = make()
    r0 = h.new_request("r0", list(range(10)))
    h.prefill(r0)
    h.finish(r0)
    assert h.manager.pool.num_free_blocks == 10
    assert h.manager.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9, 2, 1, 0]
    r1 = h.new_request("r1", list(range(10)))
    alloc = h.prefill(r1)
    assert alloc is not None and alloc.num_local_hit_tokens == 8
    assert ids(h, "r1") == [0, 1, 3]  # hits 0, 1 touched; block 3 is the queue head
    assert h.manager.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 2]
    assert h.manager.pool.blocks[0].ref_cnt == 1
    h.manager.check_integrity()


def test_eviction_is_lazy_tail_first_and_evicted_blocks_are_reused() -> None:
    h = make(num_blocks=6)
    r0 = h.new_request("r0", list(range(16)))  # 4 full blocks: 0..3
    h.prefill(r0)
    h.finish(r0)
    assert len(h.manager.pool.cached) == 4  # freed but still cached: eviction is lazy
    assert h.manager.pool.free_queue.block_ids() == [4, 5, 3, 2, 1, 0]
    r1 = h.new_request("r1", [50 + i for i in range(13)])  # needs 4 blocks
    h.prefill(r1)
    assert ids(h, "r1") == [4, 5, 3, 2]  # the chain's tail (3, then 2) is evicted first
    assert h.manager.pool.num_evictions == 2
    assert sorted(b.block_id for b in h.manager.pool.cached.values()) == [0, 1, 3, 4, 5]
    r2 = h.new_request("r2", list(range(16)))
    computed = h.manager.get_computed_blocks(r2)
    assert [b.block_id for b in computed.local_blocks] == [0, 1]  # block 2's hash was evicted
    h.check_kv()
    h.manager.check_integrity()


def test_allocation_is_all_or_nothing() -> None:
    h = make(num_blocks=4)
    h.prefill(h.new_request("r0", list(range(8))))  # 2 blocks in use, 2 free
    before = [b.ref_cnt for b in h.manager.pool.blocks]
    r1 = h.new_request("r1", [70 + i for i in range(12)])  # needs 3, only 2 free
    assert h.prefill(r1) is None
    assert [b.ref_cnt for b in h.manager.pool.blocks] == before
    assert h.manager.get_block_ids(r1) == []
    h.manager.check_integrity()


def test_request_that_can_never_fit_gets_a_clear_error() -> None:
    h = make(num_blocks=2)
    with pytest.raises(RequestTooLargeError, match="at most 8"):
        h.prefill(h.new_request("r0", list(range(9))))


def test_decode_blocks_are_cached_too() -> None:
    h = make()
    r0 = h.new_request("r0", list(range(6)))
    h.prefill(r0)
    h.decode(r0, 6)
    assert len(h.manager.pool.cached) == 1
    h.decode(r0, 7)  # the 8th token is computed: block 1 is full and cached
    assert len(h.manager.pool.cached) == 2
    r1 = h.new_request("r1", [*range(8), 42])
    assert len(h.manager.get_computed_blocks(r1).local_blocks) == 2


def test_reset_prefix_cache_refused_while_in_use() -> None:
    h = make()
    r0 = h.new_request("r0", list(range(8)))
    h.prefill(r0)
    assert not h.manager.reset_prefix_cache()
    h.finish(r0)
    assert h.manager.reset_prefix_cache()
    assert h.manager.pool.cached == {}
    h.manager.check_integrity()


def test_prefix_caching_disabled_never_hits() -> None:
    h = KvHarness(10, 4, enable_prefix_caching=False)
    h.prefill(h.new_request("r0", list(range(10))))
    alloc = h.prefill(h.new_request("r1", list(range(10))))
    assert alloc is not None and alloc.num_kv_tokens == 0
    assert h.manager.pool.cached == {}


def test_a_peers_lease_holds_blocks_and_integrity_counts_it() -> None:
    h = make()
    r0 = h.new_request("r0", list(range(10)))
    h.prefill(r0)
    h.finish(r0)  # blocks 0 and 1 stay cached, free
    hashes = r0.block_hashes[:2]
    assert h.manager.pins.pin("lease-a", [*hashes, b"not cached"]) is None  # all or nothing
    assert h.manager.pins.pin("lease-a", hashes) == [0, 1]
    h.manager.check_integrity()  # a lease's references are accounted for
    assert h.manager.num_free_blocks == 8  # pinned blocks left the free queue
    # A request hitting the pinned prefix shares the blocks; the lease still holds them.
    r1 = h.new_request("r1", [*range(8), 99])
    assert len(h.manager.get_computed_blocks(r1).local_blocks) == 2
    h.prefill(r1)
    h.manager.check_integrity()
    h.finish(r1)
    assert [b.ref_cnt for b in h.manager.pool.blocks[:2]] == [1, 1]
    h.manager.check_integrity()
    h.manager.pins.unpin("lease-a")
    h.manager.pins.unpin("lease-a")  # releasing twice is a no-op
    assert h.manager.num_free_blocks == 10
    h.manager.check_integrity()
