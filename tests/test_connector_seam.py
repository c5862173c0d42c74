"""The connector seam: called where design.md says, rolled back on failure, no-op by default."""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.kv_connector import InMemoryKvCacheConnector, NoopKvCacheConnector
from tests.kv_harness import KvHarness


class RecordingConnector(InMemoryKvCacheConnector):
    """The in-memory connector, recording every call and the pool's state at that moment."""

    def __init__(self, harness: KvHarness, fail_loads: bool = False) -> None:
        super().__init__(harness.read, harness.write)
        self.harness = harness
        self.fail_loads = fail_loads
        self.calls: list[tuple] = []

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        n = super().lookup(hashes)
        self.calls.append(("lookup", len(hashes), n))
        return n

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        refs = [self.harness.manager.pool.blocks[i].ref_cnt for i in block_ids]
        self.calls.append(("load", list(block_ids), refs))
        if self.fail_loads:
            # Injected fault: scribble over the first block, then fail.
            self.harness.write(block_ids[0], b"garbage")
            return False
        return super().load(hashes, block_ids)

    def on_hit(self, request_id: str, num_local_blocks: int, num_loaded_blocks: int) -> None:
        held = len(self.harness.manager.req_to_blocks.get(request_id, []))
        self.calls.append(("hit", request_id, num_local_blocks, num_loaded_blocks, held))

    def on_store(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        super().on_store(hashes, block_ids)
        self.calls.append(("store", list(block_ids)))

    def on_evict(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        self.calls.append(("evict", len(hashes)))

    def on_clear(self) -> None:
        self.calls.append(("clear",))


def with_connector(
    num_blocks: int = 6, fail_loads: bool = False
) -> tuple[KvHarness, RecordingConnector]:
    h = KvHarness(num_blocks, 4, lambda h: RecordingConnector(h, fail_loads))
    assert isinstance(h.manager.connector, RecordingConnector)
    return h, h.manager.connector


def seam_calls(conn: RecordingConnector) -> list[tuple]:
    """The calls of the lookup/load/hit/store path (evictions interleave with allocation)."""
    return [c for c in conn.calls if c[0] != "evict"]


def evict_r0_prefix(h: KvHarness) -> None:
    """r0 computes 16 tokens and finishes; r1 (unrelated) evicts r0's blocks 3 and 2."""
    r0 = h.new_request("r0", list(range(16)))
    h.prefill(r0)
    h.finish(r0)
    r1 = h.new_request("r1", [50 + i for i in range(13)])
    h.prefill(r1)
    h.finish(r1)


def test_noop_connector_changes_nothing() -> None:
    trace = [list(range(10)), [*range(8), 7, 7], list(range(14)), [5] * 9, list(range(10))]
    results = []
    for make in (None, lambda _: NoopKvCacheConnector()):
        h = KvHarness(5, 4, make)
        out = []
        for i, tokens in enumerate(trace):
            req = h.new_request(f"r{i}", tokens)
            alloc = h.prefill(req)
            out.append((h.manager.get_block_ids(req), alloc and alloc.num_kv_tokens))
            h.finish(req)
        out.append(h.manager.pool.free_queue.block_ids())
        results.append(out)
    assert results[0] == results[1]


def test_load_brings_back_an_evicted_block() -> None:
    h, conn = with_connector()
    evict_r0_prefix(h)
    assert ("evict", 2) in conn.calls
    conn.calls.clear()
    r2 = h.new_request("r2", list(range(16)))
    alloc = h.prefill(r2)
    assert alloc is not None
    assert alloc.num_local_hit_tokens == 8 and alloc.num_loaded_tokens == 4
    calls = seam_calls(conn)
    # hashes[2:3]: the last block is full but its last token must be computed.
    assert calls[0] == ("lookup", 1, 1)
    load = calls[1]
    assert load[0] == "load" and load[2] == [1]  # fresh blocks, allocated to r2 only
    assert calls[2] == ("store", load[1])  # registered after the load succeeded
    assert calls[3][:4] == ("hit", "r2", 2, 1)
    assert calls[3][4] == 4  # on_hit fired after all 4 blocks were allocated
    assert h.manager.pool.blocks[load[1][0]].block_hash == r2.block_hashes[2]
    h.check_kv()  # the loaded block holds exactly r0's KV for that prefix
    h.manager.check_integrity()


def test_failed_load_rolls_back_and_tokens_are_computed() -> None:
    h, conn = with_connector(fail_loads=True)
    evict_r0_prefix(h)
    evictions_before = h.manager.pool.num_evictions
    conn.calls.clear()
    r2 = h.new_request("r2", list(range(16)))
    alloc = h.prefill(r2)
    assert alloc is not None
    assert alloc.num_local_hit_tokens == 8 and alloc.num_loaded_tokens == 0
    calls = seam_calls(conn)
    # No store from the failed load; the store comes from computing the tokens afterwards.
    assert [c[0] for c in calls] == ["lookup", "load", "hit", "store"]
    assert calls[2][2:4] == (2, 0)  # the hit counts only the local blocks
    # The garbage the failed load wrote was overwritten by computing; nothing was registered
    # from the load itself.
    h.check_kv()
    # The failed block stays with the request and is computed into: same blocks, same
    # evictions as a successful load, and nothing extra was registered.
    ok, _ = with_connector()
    evict_r0_prefix(ok)
    ok_evictions_before = ok.manager.pool.num_evictions
    ok_r2 = ok.new_request("r2", list(range(16)))
    ok.prefill(ok_r2)
    assert h.manager.get_block_ids(r2) == ok.manager.get_block_ids(ok_r2)
    assert h.manager.get_block_ids(r2)[2] == calls[1][1][0]
    assert (
        h.manager.pool.num_evictions - evictions_before
        == ok.manager.pool.num_evictions - ok_evictions_before
    )
    h.manager.check_integrity()


def test_connector_exception_is_a_failed_load() -> None:
    h, conn = with_connector()
    evict_r0_prefix(h)

    def broken_writer(block_id: int, data: bytes) -> None:
        raise OSError("disk on fire")

    conn.writer = broken_writer
    alloc = h.prefill(h.new_request("r2", list(range(16))))
    assert alloc is not None and alloc.num_loaded_tokens == 0
    h.check_kv()
    h.manager.check_integrity()


def test_no_hooks_fire_when_allocation_fails() -> None:
    h, conn = with_connector(num_blocks=6)
    r0 = h.new_request("r0", list(range(16)))
    h.prefill(r0)
    h.finish(r0)
    hog = h.new_request("hog", [90 + i for i in range(16)])  # evicts r0's blocks 3 and 2
    h.prefill(hog)
    conn.calls.clear()
    r2 = h.new_request("r2", list(range(16)))
    computed = h.manager.get_computed_blocks(r2)
    assert len(computed.local_blocks) == 2 and computed.num_external_blocks == 1
    # 4 blocks: 2 local hits (both free, so they use the last 2 free blocks) + 2 new.
    assert h.manager.allocate_slots(r2, 4, computed) is None
    assert [c[0] for c in conn.calls] == ["lookup"]  # no load, no hit
    h.manager.check_integrity()


def test_clear_and_store_observed() -> None:
    h, conn = with_connector()
    r0 = h.new_request("r0", list(range(9)))
    h.prefill(r0)
    assert ("store", [0, 1]) in conn.calls
    h.finish(r0)
    assert h.manager.reset_prefix_cache()
    assert conn.calls[-1] == ("clear",)
