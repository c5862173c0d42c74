"""Random allocate / cache / free / evict / lookup sequences against the pool's invariants."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.kv_connector import InMemoryKvCacheConnector
from tests.kv_harness import KvHarness

BASES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]
BLOCK_SIZE = 2
NUM_BLOCKS = 12


class FlakyConnector(InMemoryKvCacheConnector):
    """Fault injection: while ``failing``, loads write garbage and fail."""

    failing = False

    def load(self, hashes: Sequence[BlockHash], block_ids: Sequence[int]) -> bool:
        if self.failing:
            for block_id in block_ids:
                self.writer(block_id, b"garbage")
            return False
        return super().load(hashes, block_ids)


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.h = KvHarness(
            NUM_BLOCKS, BLOCK_SIZE, lambda h: FlakyConnector(h.read, h.write, capacity=8)
        )
        assert isinstance(self.h.manager.connector, FlakyConnector)
        self.conn = self.h.manager.connector
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.n = 0

    @rule(base=st.sampled_from(BASES), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 3)))
    def add_request(self, base: list[int], cut: int, tail: list[int]) -> None:
        tokens = (base[:cut] + tail)[:16] or [0]
        rid = f"r{self.n}"
        self.n += 1
        self.h.new_request(rid, tokens)
        self.waiting.append(rid)

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100))
    def prefill(self, i: int) -> None:
        rid = self.waiting[i % len(self.waiting)]
        req = self.h.requests[rid]
        if req.num_tokens > NUM_BLOCKS * BLOCK_SIZE:
            return
        alloc = self.h.prefill(req)
        if alloc is not None:
            self.waiting.remove(rid)
            self.running.append(rid)
            for block in alloc.new_blocks:
                assert block.ref_cnt == 1, "a new block is shared"

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100), token=st.integers(0, 3))
    def decode(self, i: int, token: int) -> None:
        rid = self.running[i % len(self.running)]
        if self.h.requests[rid].num_tokens >= NUM_BLOCKS * BLOCK_SIZE:
            return
        if not self.h.decode(self.h.requests[rid], token):  # preempted
            self.running.remove(rid)
            self.waiting.append(rid)

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def finish(self, i: int) -> None:
        rid = self.running.pop(i % len(self.running))
        self.h.finish(self.h.requests[rid])

    @precondition(lambda self: self.running)
    @rule(i=st.integers(0, 100))
    def preempt(self, i: int) -> None:
        rid = self.running.pop(i % len(self.running))
        req = self.h.requests[rid]
        self.h.manager.free(req)
        req.num_kv_tokens = 0
        self.waiting.append(rid)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.h.manager.reset_prefix_cache() == (not self.running)

    @rule(failing=st.booleans())
    def set_failing(self, failing: bool) -> None:
        self.conn.failing = failing

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 100))
    def lookup_is_side_effect_free(self, i: int) -> None:
        req = self.h.requests[self.waiting[i % len(self.waiting)]]
        refs = [b.ref_cnt for b in self.h.manager.pool.blocks]
        queue = self.h.manager.pool.free_queue.block_ids()
        computed = self.h.manager.get_computed_blocks(req)
        for j, block in enumerate(computed.local_blocks):
            assert block.block_hash == req.block_hashes[j]
        assert refs == [b.ref_cnt for b in self.h.manager.pool.blocks]
        assert queue == self.h.manager.pool.free_queue.block_ids()

    @invariant()
    def integrity(self) -> None:
        self.h.manager.check_integrity()
        self.h.check_kv()
        assert set(self.h.manager.req_to_blocks) <= set(self.running)


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase
