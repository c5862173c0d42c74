"""What the KV cache manager (kv_cache_manager.py) answers the scheduler: a prefix lookup's
``ComputedBlocks``, an ``Allocation``, a background load's ``LoadOutcome``, and
``RequestTooLargeError`` for a request that can never fit."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.workers.block_pool import KVBlock
from kvmesh.workers.request import Request


@dataclass(frozen=True)
class ComputedBlocks:
    """The result of a prefix lookup: local hits, then blocks the connector says it has."""

    local_blocks: tuple[KVBlock, ...] = ()
    num_external_blocks: int = 0


@dataclass(frozen=True)
class Allocation:
    """What ``allocate_slots`` did. Token counts are multiples of the block size."""

    new_blocks: tuple[KVBlock, ...]  # blocks to compute into (loaded or loading excluded)
    num_local_hit_tokens: int = 0
    num_loaded_tokens: int = 0
    # Tokens a background load is filling: the request waits until ``poll_loads`` says.
    num_loading_tokens: int = 0
    loaded_medium: str = "peer"  # where the loaded tokens came from (``LoadResult.medium``)
    loaded_disk_tokens: int = 0  # of a tier load's, those read from disk (the rest: host)

    @property
    def num_kv_tokens(self) -> int:
        """Tokens whose KV the request holds before this step computes anything."""
        return self.num_local_hit_tokens + self.num_loaded_tokens


@dataclass(frozen=True)
class LoadOutcome:
    """A request's background load ended (``poll_loads``)."""

    request: Request
    num_loaded_tokens: int  # registered; the rest of the loading tokens are to be computed
    # The load's blocks are quarantined: the request now holds no blocks and starts over,
    # computing its prefix (``request.may_pull`` is False).
    restart: bool = False
    medium: str = "peer"  # where the loaded tokens came from (``LoadResult.medium``)
    disk_tokens: int = 0  # of a tier load's, those read from disk (the rest: host)
    # The load's peer reads (``LoadResult.read_blocks`` / ``read_s`` / ``read_from``).
    read_blocks: int = 0
    read_s: float = 0.0
    read_from: str | None = None


class RequestTooLargeError(ValueError):
    """The request's tokens can never fit in the pool, however empty it gets."""
