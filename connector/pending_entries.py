"""Pending entries: the routers' shared view of prompts being computed right now.

An entry says "worker w is computing these leading blocks of a prompt now, with ``tokens``
prompt tokens still to compute". Whoever routes a prompt adds one and drops it when the prompt
is computed; a ``Stored`` of the entry's last block from that worker (``stored``), the worker's
purge (``drop_worker``) or the entry's time to live drops it too, so an ingress that dies never
leaves one behind for long.

Anyone may add an entry (routers hold no worker's token), so an entry is believed only
briefly until its worker confirms it (``confirm``): the worker does when the routed request
reaches it, with the hashes of the prompt it was given. Until then the entry lives at most
``UNCONFIRMED_TTL_S``; a forged one (a prompt the worker never got) makes followers wait for
it that long at most, not its whole time to live.

``KvIndex`` (connector/kv_index.py) owns one ``PendingEntries`` and answers held blocks and
pending ones together in ``route_lookup``.

No torch, no ray. Not thread-safe: the index actor holds a lock around its index.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.connector.events import require_block_hashes

# How long a pending entry lives unless dropped or stored first (an ingress may die holding it).
DEFAULT_PENDING_TTL_S = 120.0
# Any Ray caller can add entries (routers hold no worker token), so what they cost is bounded:
# an entry lives at most MAX_PENDING_TTL_S, and past MAX_PENDING_ENTRIES live entries or
# MAX_PENDING_HASHES hashes in them a new entry drops those that expire first. A flood costs
# routing hints, never the index's memory, and a lookup's pass over the entries (summary)
# stays short. A live entry stands for a routed request that has not started: thousands
# per cluster, not tens of thousands.
MAX_PENDING_TTL_S = DEFAULT_PENDING_TTL_S
# How long an entry lives before its worker confirms it: longer than a routed request takes
# to reach its worker replica (a hop through Serve), short enough that a forged entry costs
# little.
UNCONFIRMED_TTL_S = 10.0
MAX_PENDING_ENTRIES = 16_384
MAX_PENDING_HASHES = 1 << 20
# How long an ended pending entry still counts as a race: longer than a router's lookup and
# claim take (two index calls), short enough to keep the record small.
RACE_WINDOW_S = 10.0
COUNTERS = (
    "pending_added",
    "pending_stored",
    "pending_expired",
    "pending_raced",
    "pending_evicted",
    "pending_confirmed",
)


@dataclass(slots=True)
class _PendingEntry:
    worker_id: str
    hashes: tuple[bytes, ...]
    tokens: int
    expires: float
    ttl_s: float  # what it was added for: its time to live once confirmed
    confirmed: bool = False


class PendingEntries:
    """Every worker's pending entries, their expiry and the ones ended lately.

    Contracts: an entry lives until :meth:`drop`, its time to live (on ``clock``: at most
    ``UNCONFIRMED_TTL_S`` until :meth:`confirm`, then its ``ttl_s``, at most
    ``MAX_PENDING_TTL_S``), :meth:`stored` of its last hash by its worker, :meth:`drop_worker`,
    or a newer entry past ``max_entries`` / ``max_hashes`` (the one expiring first goes). Ids
    are never reused; ``last_id`` is the newest, a version of the whole set that routers quote
    back as ``seen``.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        max_entries: int = MAX_PENDING_ENTRIES,
        max_hashes: int = MAX_PENDING_HASHES,
    ) -> None:
        self._clock = clock
        self.max_entries, self.max_hashes = max_entries, max_hashes
        self._num_hashes = 0  # in live entries
        self.counts = dict.fromkeys(COUNTERS, 0)
        self._pending: dict[str, dict[int, _PendingEntry]] = {}  # worker -> its entries, FIFO
        self._pending_last: dict[str, dict[bytes, set[int]]] = {}  # worker -> last hash -> ids
        self._pending_owner: dict[int, str] = {}  # pending id -> worker
        self._expiry: list[tuple[float, int]] = []  # heap of (expires, pending id)
        self._pending_ids = itertools.count(1)
        self.last_id = 0
        # Entries ended lately, oldest first: (ended at, id, worker, first hash). One that
        # ended between a router's lookup and its claim (its prefix stored meanwhile) raced
        # the claim just as a live one does.
        self._ended: deque[tuple[float, int, str, bytes]] = deque()

    def __len__(self) -> int:
        return len(self._pending_owner)

    def add(
        self,
        worker_id: str,
        hashes: Sequence[bytes],
        tokens: int,
        ttl_s: float = DEFAULT_PENDING_TTL_S,
        seen: int | None = None,
    ) -> int | None:
        """Record that ``worker_id`` is computing the leading blocks ``hashes`` of a prompt, with
        ``tokens`` prompt tokens still to compute; returns the entry's id (never reused).

        ``seen``: the ``last_pending_id`` of the ``KvIndex.route_lookup`` the decision was made
        on. If another worker has added an entry for the same prompt since (another router
        raced this one), nothing is added and None is returned: decide again on a fresh
        lookup, or both workers would compute the same prefix.

        ``hashes`` may be empty (a prompt shorter than a block still adds to the backlog).
        Raises ValueError for a bad worker id, hash, ``tokens`` or ``ttl_s``.
        """
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")
        chain = tuple(hashes)
        require_block_hashes(chain, "pending")
        if type(tokens) is not int or tokens < 0:
            raise ValueError(f"tokens must be a non-negative int, got {tokens!r}")
        if not isinstance(ttl_s, int | float) or not 0 < ttl_s <= MAX_PENDING_TTL_S:
            raise ValueError(f"ttl_s must be in (0, {MAX_PENDING_TTL_S:g}] s, got {ttl_s!r}")
        if len(chain) > self.max_hashes:
            raise ValueError(f"pending: at most {self.max_hashes} hashes, got {len(chain)}")
        self.expire()
        if seen is not None and chain and self._raced(worker_id, chain[0], seen):
            self.counts["pending_raced"] += 1
            return None
        while (
            len(self._pending_owner) >= self.max_entries
            or self._num_hashes + len(chain) > self.max_hashes
        ):
            expires, oldest = heapq.heappop(self._expiry)
            # Items of dropped entries, and a confirmed entry's first, are stale: skipped.
            if self._expires(oldest) == expires and self.drop(oldest):
                self.counts["pending_evicted"] += 1
        pending_id = next(self._pending_ids)
        self.last_id = pending_id
        now = self._clock()
        entry = _PendingEntry(worker_id, chain, tokens, now + min(ttl_s, UNCONFIRMED_TTL_S), ttl_s)
        self._num_hashes += len(chain)
        self._pending.setdefault(worker_id, {})[pending_id] = entry
        self._pending_owner[pending_id] = worker_id
        if chain:
            last = self._pending_last.setdefault(worker_id, {})
            last.setdefault(chain[-1], set()).add(pending_id)
        heapq.heappush(self._expiry, (entry.expires, pending_id))
        self.counts["pending_added"] += 1
        return pending_id

    def confirm(self, pending_id: int, worker_id: str, hashes: Sequence[bytes]) -> bool:
        """``worker_id`` got the request of entry ``pending_id``, whose prompt has block hashes
        ``hashes`` (the worker's own): the entry lives its whole ``ttl_s`` from now. False
        (nothing changes) when the entry is gone, another worker's, or claims blocks that
        prompt does not have."""
        entry = self._pending.get(worker_id, {}).get(pending_id)
        if entry is None or common_prefix(entry.hashes, hashes) < len(entry.hashes):
            return False
        if not entry.confirmed:
            entry.confirmed = True
            entry.expires = self._clock() + entry.ttl_s
            heapq.heappush(self._expiry, (entry.expires, pending_id))
            self.counts["pending_confirmed"] += 1
        return True

    def _raced(self, worker_id: str, first: bytes, seen: int) -> bool:
        """Another worker's entry for a prompt starting with block ``first``, newer than
        ``seen``: live, or ended (stored, dropped) within ``RACE_WINDOW_S``."""
        self._forget_ended()
        return any(
            i > seen and e.hashes and e.hashes[0] == first
            for w, entries in self._pending.items()
            if w != worker_id
            for i, e in entries.items()
        ) or any(i > seen and w != worker_id and h == first for _, i, w, h in self._ended)

    def _forget_ended(self) -> None:
        horizon = self._clock() - RACE_WINDOW_S
        while self._ended and self._ended[0][0] < horizon:
            self._ended.popleft()

    def drop(self, pending_id: int) -> bool:
        """Forget a pending entry; False if it is already gone (dropped, stored, expired)."""
        worker_id = self._pending_owner.pop(pending_id, None)
        if worker_id is None:
            return False
        mine = self._pending[worker_id]
        entry = mine.pop(pending_id)
        self._num_hashes -= len(entry.hashes)
        if not mine:
            del self._pending[worker_id]
        if entry.hashes:
            self._ended.append((self._clock(), pending_id, worker_id, entry.hashes[0]))
            self._forget_ended()
            last = self._pending_last[worker_id]
            ids = last[entry.hashes[-1]]
            ids.discard(pending_id)
            if not ids:
                del last[entry.hashes[-1]]
                if not last:
                    del self._pending_last[worker_id]
        # Its heap item stays; expire_pending skips items of entries already gone.
        return True

    def expire(self) -> int:
        """Drop the entries whose time to live is over; returns how many."""
        now, heap, n = self._clock(), self._expiry, 0
        while heap and heap[0][0] <= now:
            expires, pending_id = heapq.heappop(heap)
            if self._expires(pending_id) == expires and self.drop(pending_id):
                n += 1
        if len(heap) > 64 and len(heap) > 4 * len(self._pending_owner):  # dropped entries' items
            self._expiry = [(e.expires, i) for w in self._pending.values() for i, e in w.items()]
            heapq.heapify(self._expiry)
        self.counts["pending_expired"] += n
        return n

    def next_expiry(self) -> float | None:
        """When (on the clock) the next entry expires, or None when none is pending."""
        heap = self._expiry
        while heap and self._expires(heap[0][1]) != heap[0][0]:  # dropped, or confirmed
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def _expires(self, pending_id: int) -> float | None:
        """When a live entry expires now (a confirmed entry's first heap item is stale)."""
        worker_id = self._pending_owner.get(pending_id)
        return None if worker_id is None else self._pending[worker_id][pending_id].expires

    def stored(self, worker_id: str, stored: Iterable[bytes]) -> None:
        """Drop the worker's entries whose last hash it just stored."""
        last = self._pending_last.get(worker_id)
        if not last:
            return
        done = [i for h in stored if h in last for i in last[h]]
        for pending_id in done:
            if self.drop(pending_id):
                self.counts["pending_stored"] += 1

    def depth(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """The longest leading run of ``hashes`` one pending entry of ``worker_id`` covers."""
        self.expire()
        entries = self._pending.get(worker_id, {}).values()
        return max((common_prefix(e.hashes, hashes) for e in entries), default=0)

    def drop_worker(self, worker_id: str) -> None:
        """Drop every entry of ``worker_id`` (its purge)."""
        for pending_id in list(self._pending.get(worker_id, ())):
            self.drop(pending_id)

    def summary(self, hashes: Sequence[bytes]) -> dict[str, dict]:
        """``pending``, ``backlog`` and ``queued`` of :meth:`KvIndex.route_lookup`."""
        self.expire()
        pending: dict[str, dict[str, int]] = {}
        backlog: dict[str, int] = {}
        queued: dict[str, int] = {}
        first = hashes[0] if hashes else None
        for worker_id, entries in self._pending.items():
            total = depth = wait = 0
            for e in entries.values():  # insertion order: the order they were routed in
                total += e.tokens
                if e.hashes and e.hashes[0] == first:
                    d = common_prefix(e.hashes, hashes)
                    if d > depth:
                        depth, wait = d, total
            backlog[worker_id] = total
            queued[worker_id] = len(entries)
            if depth:
                pending[worker_id] = {"depth": depth, "wait_tokens": wait}
        return {"pending": pending, "backlog": backlog, "queued": queued}

    def entries(self) -> dict[int, dict[str, Any]]:
        """Every live entry by id: ``{"worker_id", "hashes", "tokens", "expires"}``."""
        self.expire()
        return {
            i: {
                "worker_id": e.worker_id,
                "hashes": list(e.hashes),
                "tokens": e.tokens,
                "expires": e.expires,
            }
            for entries in self._pending.values()
            for i, e in entries.items()
        }

    def check_integrity(self) -> None:
        """Assert that entries, owners, last hashes and the expiry heap agree."""
        owners = {i: w for w, es in self._pending.items() for i in es}
        assert owners == self._pending_owner, "pending entries and owners disagree"
        assert all(self._pending.values()), "a worker without pending entries is listed"
        lasts = {
            (w, h, i)
            for w, last in self._pending_last.items()
            for h, ids in last.items()
            for i in ids
        }
        want = {
            (w, e.hashes[-1], i)
            for w, es in self._pending.items()
            for i, e in es.items()
            if e.hashes
        }
        assert lasts == want, "pending last-hash map is stale"
        live = {(e.expires, i) for es in self._pending.values() for i, e in es.items()}
        assert live <= set(self._expiry), "a pending entry never expires"
        hashes = sum(len(e.hashes) for es in self._pending.values() for e in es.values())
        assert hashes == self._num_hashes, "the live entries' hash count is stale"
        assert len(owners) <= self.max_entries and hashes <= self.max_hashes, "over budget"


def common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading hashes ``a`` and ``b`` share.

    Chained hashes name a block and its whole prefix, so ``a[i] == b[i]`` implies every earlier
    pair is equal too: a binary search over positions suffices.
    """
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo]; a[hi] != b[hi] or hi is the end
    if hi and a[hi - 1] == b[hi - 1]:
        return hi
    while lo < hi:
        mid = (lo + hi) // 2  # a[mid] == b[mid] means the shared prefix is longer than mid
        if a[mid] == b[mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo
