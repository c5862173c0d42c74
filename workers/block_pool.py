"""A pool of paged KV blocks with ref counts, an LRU free queue and a hash -> block map.

Pure bookkeeping: integers and bytes, no tensors. A block's id is its index in the KV cache
tensor that the worker owns.

Lifecycle of a block: free and empty -> in use (ref_cnt > 0) -> maybe cached (it holds a full
block whose hash is in the map) -> free again (ref_cnt == 0, appended to the free queue, still
cached) -> either touched by a prefix hit (back in use, no recompute) or popped from the
head of the free queue for reuse, which is when its hash is evicted (lazily, not at free time).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvmesh.workers.block_hash import BlockHash

# (hashes, block ids): called before the blocks are handed out, while they still hold that KV.
EvictListener = Callable[[list[BlockHash], list[int]], None]


@dataclass(eq=False)
class KVBlock:
    """One physical block. Identity is the object (and ``block_id``), never its contents."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Blocks with ref_cnt 0, least recently freed first.

    An OrderedDict keyed by block id gives O(1) append, popleft and remove-from-the-middle (a
    prefix hit on a free cached block takes it out of the queue).
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._q: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in blocks)

    def __len__(self) -> int:
        return len(self._q)

    def __contains__(self, block: KVBlock) -> bool:
        return block.block_id in self._q

    def popleft(self) -> KVBlock:
        return self._q.popitem(last=False)[1]

    def append(self, block: KVBlock) -> None:
        self._q[block.block_id] = block

    def appendleft(self, block: KVBlock) -> None:
        self._q[block.block_id] = block
        self._q.move_to_end(block.block_id, last=False)

    def remove(self, block: KVBlock) -> None:
        del self._q[block.block_id]

    def block_ids(self) -> list[int]:
        """Ids in eviction order (head first), for tests and debugging."""
        return list(self._q)


class BlockPool:
    """Owns every block's ref count, the free queue and the cached-hash map."""

    def __init__(self, num_blocks: int, on_evict: EvictListener | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVBlock] = {}
        self.on_evict = on_evict
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Pop ``n`` blocks from the head of the free queue, evicting their hashes.

        Raises ValueError when fewer than ``n`` blocks are free: callers check first.
        """
        if n > len(self.free_queue):
            raise ValueError(f"cannot get {n} blocks: only {len(self.free_queue)} are free")
        out: list[KVBlock] = []
        evicted: list[BlockHash] = []
        evicted_ids: list[int] = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                evicted_ids.append(block.block_id)
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted:
            self.num_evictions += len(evicted)
            if self.on_evict is not None:
                self.on_evict(evicted, evicted_ids)
        return out

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on blocks found by a prefix hit (a free one leaves the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Sequence[KVBlock], *, front: bool = False) -> None:
        """Drop one reference from each block, in order; blocks reaching 0 join the queue.

        Callers pass a request's blocks tail first, so a chain's tail is evicted before its
        head. ``front=True`` puts blocks that hold nothing at the head, to be reused first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if front:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a full block under its hash; False when nothing was registered.

        Nothing is registered when the block already holds a hash or when another block
        already holds this hash (two requests computed the same block at once): the map
        keeps one block per hash and the other stays a private, uncached block.
        """
        if block.block_hash is not None or block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    def _uncache(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def check_integrity(self) -> None:
        """Assert the pool's invariants; tests call it after every step."""
        in_use = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert all(b.ref_cnt >= 0 for b in self.blocks), "negative ref count"
        assert len(self.free_queue) + in_use == self.num_blocks, (
            f"free {len(self.free_queue)} + in use {in_use} != total {self.num_blocks}"
        )
        for block in self.blocks:
            assert (block.ref_cnt == 0) == (block in self.free_queue), f"{block} queue mismatch"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"map entry for {block} holds another hash"
        hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert hashed == len(self.cached), "a block holds a hash that the map does not"
