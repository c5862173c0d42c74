"""The host tier's blocks: an LRU of block hashes over the slots of one slab of host memory.

The slab is allocated once at start (``memory_room`` allocates it with the pool; pinned on a
GPU worker), and a block lives in one fixed-size slot of it, so a demotion copies a pool block
straight into its slot and a load copies straight out (workers/kv_tiers.py). No lock of its
own: ``KvTiers``' lock guards it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch

from kvmesh.workers.block_hash import BlockHash


class HostSlots:
    """Which block each slot holds, least recently used first, and the slots kept from reuse."""

    def __init__(
        self, capacity: int, block_nbytes: int, memory: torch.Tensor | None = None
    ) -> None:
        """``capacity`` slots of ``block_nbytes``; ``memory``: their slab (a uint8 CPU tensor
        of that size), or None for one of its own."""
        self.capacity = capacity
        self.block_nbytes = block_nbytes
        if memory is None:
            memory = torch.zeros(capacity * block_nbytes, dtype=torch.uint8)
        self._slab = memory.reshape(-1)  # its own memory, not a copy
        if self._slab.numel() != capacity * block_nbytes:
            raise ValueError("host_memory: not the host tier's size")
        self._lru: OrderedDict[BlockHash, int] = OrderedDict()  # oldest first -> slot
        self._free = list(range(capacity - 1, -1, -1))
        # Blocks a load or a promotion copies from (``KvTiers.holding``): not reused meanwhile.
        self.held: set[BlockHash] = set()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def __iter__(self) -> Iterator[BlockHash]:
        """The blocks, least recently used first."""
        return iter(self._lru)

    def slot(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s bytes, in the slab (not a copy)."""
        return self._slab[slot * self.block_nbytes : (slot + 1) * self.block_nbytes]

    def view(self, block_hash: BlockHash) -> torch.Tensor | None:
        """The block's bytes in its slot (not a copy), now its most recently used; None when
        no slot holds it."""
        slot = self._lru.get(block_hash)
        if slot is None:
            return None
        self._lru.move_to_end(block_hash)
        return self.slot(slot)

    def touch(self, hashes: Sequence[BlockHash]) -> None:
        """Mark the blocks of ``hashes`` held here the most recently used, the first last."""
        for h in reversed(hashes):
            if h in self._lru:
                self._lru.move_to_end(h)

    def take(self) -> tuple[int, tuple[BlockHash, torch.Tensor] | None] | None:
        """A slot for a new block (``put`` it there): a free one, or when none is free that of
        the least recently used block not ``held``, which leaves; then also that block and
        its bytes, still in the slot (copy them before writing it). None: every slot is
        held."""
        if self._free:
            return self._free.pop(), None
        oldest = next((h for h in self._lru if h not in self.held), None)
        if oldest is None:
            return None
        slot = self._lru.pop(oldest)
        return slot, (oldest, self.slot(slot))

    def put(self, block_hash: BlockHash, slot: int) -> None:
        """Slot ``slot`` (from ``take``) holds the block now, its most recently used."""
        self._lru[block_hash] = slot
