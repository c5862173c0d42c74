"""The cluster-wide KV block index: which worker holds which block, fed by event batches.

``KvIndex`` maps ``hash -> workers`` and ``worker -> hashes``; a lookup walks a request's chain
of block hashes and answers each worker's longest held prefix. Workers feed it numbered
batches (connector/events.py); a gap in a worker's numbering freezes that worker until it sends
a full snapshot. Answers are hints: a block can leave a worker right after a lookup.

It also keeps *pending* entries (connector/pending_entries.py), shared routing state: "worker w
is computing these leading blocks of a prompt now". A ``Stored`` of an entry's last block from
its worker, or the worker's purge, ends it here. :meth:`KvIndex.route_lookup` answers both,
held blocks and pending ones, so several ingress replicas see each other's in-flight prompts.

Workers are not trusted to be who they say (any Ray driver can call the index): ``register``
hands out a secret token per worker, and every call that changes that worker's state (its
batches, snapshots, deregistration, a re-registration) must carry it; a call with a wrong or
missing token is refused and counted (``unauthorized``).

No torch, no ray. Not thread-safe: the actor (connector/index_actor.py) holds a lock around it.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, Literal

from kvmesh.connector.events import (
    KIND_CLEARED,
    KIND_STORED,
    MalformedBatch,
    Record,
    decode_records,
    require_block_hashes,
)
from kvmesh.connector.pending_entries import (
    DEFAULT_PENDING_TTL_S,
    PendingEntries,
)

ApplyStatus = Literal["applied", "duplicate", "gap", "rejected"]

# Holder sets are interned frozensets: the many blocks of a chain held by the same workers share
# one object (memory), and a lookup skips a block whose holder set *is* the previous one.
# The transition caches are only an optimisation, so they are simply dropped when they grow.
_MAX_INTERNED = 1 << 16

_COUNTERS = ("events_applied", "batches_applied", "batches_rejected", "duplicates", "gaps")
_COUNTERS += (
    "lookups",
    "removes_ignored",
    "unauthorized",  # calls and batches refused for a wrong or missing worker token
)


@dataclass(frozen=True, slots=True)
class ApplyResult:
    """What :meth:`KvIndex.apply` did with a batch; ``reason`` says why one was not applied."""

    status: ApplyStatus
    worker_id: str | None = None
    seq: int | None = None
    reason: str | None = None


@dataclass(slots=True)
class _Worker:
    fingerprint: str
    metadata: dict[str, Any]
    token: str  # the secret its calls must carry; never in ``workers()``
    expected_seq: int = 0
    needs_snapshot: bool = False


class KvIndex:
    """The block index of one model fingerprint.

    Contracts:
    - A worker's batches are applied in ``seq`` order, each whole or not at all. A batch with
      ``seq`` below the expected one is a duplicate (ignored); above it, a gap: it is not applied
      and the worker needs a snapshot, and until :meth:`apply_snapshot` every later batch is
      refused as a gap too. Malformed batches and batches of unknown workers are rejected.
    - ``Stored`` of a held hash is a no-op; ``Removed`` of a hash not held is ignored (counted).
    - :meth:`lookup` answers, per worker, the longest prefix of the chain it holds.
    - A pending entry lives until :meth:`drop_pending`, its ``ttl_s`` (on ``clock``), an applied
      ``Stored`` (batch or snapshot) of its last hash by its worker, or its worker's purge.
      Pending entries of unregistered workers are accepted: an index that just restarted learns
      of its workers only as they rejoin.
    """

    def __init__(self, fingerprint: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint = fingerprint
        self._clock = clock
        self._holders: dict[bytes, frozenset[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._workers: dict[str, _Worker] = {}
        self._single: dict[str, frozenset[str]] = {}
        self._with: dict[tuple[frozenset[str], str], frozenset[str]] = {}
        self._without: dict[tuple[frozenset[str], str], frozenset[str]] = {}
        self._sets: dict[frozenset[str], frozenset[str]] = {}
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._pending = PendingEntries(clock)

    # -- workers ---------------------------------------------------------------------------

    def register(
        self,
        worker_id: str,
        fingerprint: str,
        metadata: dict | None = None,
        token: str | None = None,
    ) -> str:
        """Admit a worker of this index's fingerprint, expecting its batch ``seq`` 0; returns
        its new secret token, which its later calls must carry.

        A known ``worker_id`` is taken to be a new incarnation: its blocks are purged and its
        numbering restarts at 0 (had we kept them, a restarted publisher's batches would all
        look like duplicates; a live worker that merely re-registers gets a gap and a snapshot).
        Its pending entries stay: the prompts they stand for may still be running. Only the
        holder of its current ``token`` may re-register a known worker (else anyone could take
        its name over); the token changes.
        Raises ValueError for another fingerprint, naming both, and PermissionError for a known
        worker without its token.
        """
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")
        if fingerprint != self.fingerprint:
            raise ValueError(
                f"worker {worker_id!r} has model fingerprint {fingerprint!r}, but this index "
                f"serves {self.fingerprint!r}: workers of different fingerprints never share KV"
            )
        if worker_id in self._workers:
            self.authorize(worker_id, token)
        self._drop_blocks(worker_id)
        new_token = secrets.token_hex(16)
        self._workers[worker_id] = _Worker(fingerprint, dict(metadata or {}), new_token)
        self._blocks[worker_id] = set()
        return new_token

    def check_token(self, worker_id: str, token: object) -> bool:
        """Whether ``token`` is the registered ``worker_id``'s (False for an unknown worker);
        a False answer is counted as ``unauthorized``."""
        state = self._workers.get(worker_id)
        ok = (
            state is not None
            and isinstance(token, str)
            and secrets.compare_digest(token.encode(), state.token.encode())
        )
        if not ok:
            self._counts["unauthorized"] += 1
        return ok

    def authorize(self, worker_id: str, token: object) -> None:
        """Raise PermissionError unless :meth:`check_token`."""
        if not self.check_token(worker_id, token):
            raise PermissionError(f"wrong or missing token for worker {worker_id!r}")

    def deregister(self, worker_id: str, token: str | None) -> bool:
        """:meth:`purge`, for the worker itself: False if it was not registered, and
        PermissionError for a wrong token."""
        if worker_id not in self._workers:
            return False
        self.authorize(worker_id, token)
        return self.purge(worker_id)

    def purge(self, worker_id: str) -> bool:
        """Forget a worker, its blocks and its pending entries in O(its blocks); False if it
        was not registered."""
        self._pending.drop_worker(worker_id)
        self._drop_blocks(worker_id)
        self._blocks.pop(worker_id, None)
        self._single.pop(worker_id, None)
        return self._workers.pop(worker_id, None) is not None

    def needs_snapshot(self, worker_id: str) -> bool:
        """Whether a gap froze this worker until :meth:`apply_snapshot`; KeyError if unknown."""
        return self._workers[worker_id].needs_snapshot

    def workers(self) -> dict[str, dict]:
        """Each registered worker's metadata (copies)."""
        return {w: dict(s.metadata) for w, s in self._workers.items()}

    # -- events ----------------------------------------------------------------------------

    def apply(self, data: bytes, token: str | Mapping[str, str] | None) -> ApplyResult:
        """Decode, validate and apply one encoded batch, whole or not at all.

        ``token``: the batch's worker's token, or a mapping from worker id to token (a caller
        batching several workers' batches). A wrong or missing one rejects the batch.
        """
        try:
            worker_id, seq, records = decode_records(data)
        except MalformedBatch as e:
            self._counts["batches_rejected"] += 1
            return ApplyResult("rejected", reason=str(e))
        state = self._workers.get(worker_id)
        if state is None:
            self._counts["batches_rejected"] += 1
            return ApplyResult("rejected", worker_id, seq, f"unknown worker {worker_id!r}")
        if isinstance(token, Mapping):
            token = token.get(worker_id)
        if not self.check_token(worker_id, token):
            self._counts["batches_rejected"] += 1
            return ApplyResult("rejected", worker_id, seq, f"wrong token for {worker_id!r}")
        if seq < state.expected_seq:
            self._counts["duplicates"] += 1
            return ApplyResult("duplicate", worker_id, seq)
        if seq > state.expected_seq or state.needs_snapshot:
            self._counts["gaps"] += 1
            state.needs_snapshot = True
            reason = f"expected seq {state.expected_seq}, got {seq}"
            return ApplyResult("gap", worker_id, seq, reason)
        self._apply_records(worker_id, records)
        state.expected_seq = seq + 1
        self._counts["batches_applied"] += 1
        return ApplyResult("applied", worker_id, seq)

    def apply_snapshot(
        self, worker_id: str, hashes: Iterable[bytes], next_seq: int, token: str | None
    ) -> None:
        """Replace a worker's blocks wholesale, clear its gap, expect ``next_seq`` next.

        Raises KeyError for an unknown worker, PermissionError for a wrong token and
        ValueError for a bad hash or ``next_seq``; on error nothing changes.
        """
        state = self._workers[worker_id]
        self.authorize(worker_id, token)
        new = set(hashes)
        require_block_hashes(new, "snapshot")
        if type(next_seq) is not int or next_seq < 0:
            raise ValueError(f"next_seq must be a non-negative int, got {next_seq!r}")
        mine = self._blocks[worker_id]
        self._remove(worker_id, mine - new)
        self._add(worker_id, new - mine)
        state.expected_seq = next_seq
        state.needs_snapshot = False
        self._pending.stored(worker_id, new)

    def _apply_records(self, worker_id: str, records: list[Record]) -> None:
        events = 0
        for kind, hashes, _parent in records:
            if kind == KIND_STORED:
                self._add(worker_id, set(hashes).difference(self._blocks[worker_id]))
                self._pending.stored(worker_id, hashes)
            elif kind == KIND_CLEARED:
                self._drop_blocks(worker_id)
            else:
                held = self._blocks[worker_id].intersection(hashes)
                self._counts["removes_ignored"] += len(hashes) - len(held)
                self._remove(worker_id, held)
            events += len(hashes) or 1
        self._counts["events_applied"] += events

    def _add(self, worker_id: str, new: set[bytes]) -> None:
        """Add ``new`` (hashes the worker does not hold yet) to its blocks."""
        if not new:
            return
        single = self._single.get(worker_id)
        if single is None:
            single = self._single[worker_id] = frozenset((worker_id,))
        holders, with_, get = self._holders, self._with, self._holders.get
        for h in new:
            s = get(h)
            if s is None:
                holders[h] = single
            else:
                t = with_.get((s, worker_id))
                if t is None:
                    if len(with_) > _MAX_INTERNED:
                        with_.clear()
                    t = with_[(s, worker_id)] = self._intern(s | single)
                holders[h] = t
        self._blocks[worker_id] |= new

    def _remove(self, worker_id: str, gone: Iterable[bytes]) -> None:
        """Remove ``gone`` (hashes the worker holds) from its blocks."""
        holders, without = self._holders, self._without
        mine = self._blocks[worker_id]
        for h in gone:
            s = holders[h]
            if len(s) == 1:
                del holders[h]
            else:
                t = without.get((s, worker_id))
                if t is None:
                    if len(without) > _MAX_INTERNED:
                        without.clear()
                    t = without[(s, worker_id)] = self._intern(s - {worker_id})
                holders[h] = t
            mine.discard(h)

    def _intern(self, holders: frozenset[str]) -> frozenset[str]:
        """The one shared object equal to ``holders`` (whichever order workers arrived in)."""
        if len(self._sets) > _MAX_INTERNED:
            self._sets.clear()
        return self._sets.setdefault(holders, holders)

    def _drop_blocks(self, worker_id: str) -> None:
        mine = self._blocks.get(worker_id)
        if mine:
            self._remove(worker_id, list(mine))

    # -- pending entries (connector/pending_entries.py) ----------------------------------------

    def add_pending(
        self,
        worker_id: str,
        hashes: Sequence[bytes],
        tokens: int,
        ttl_s: float = DEFAULT_PENDING_TTL_S,
        seen: int | None = None,
    ) -> int | None:
        """:meth:`PendingEntries.add`."""
        return self._pending.add(worker_id, hashes, tokens, ttl_s, seen)

    def drop_pending(self, pending_id: int) -> bool:
        """:meth:`PendingEntries.drop`."""
        return self._pending.drop(pending_id)

    def expire_pending(self) -> int:
        """:meth:`PendingEntries.expire`."""
        return self._pending.expire()

    def next_pending_expiry(self) -> float | None:
        """:meth:`PendingEntries.next_expiry`."""
        return self._pending.next_expiry()

    def pending_depth(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """:meth:`PendingEntries.depth`."""
        return self._pending.depth(worker_id, hashes)

    def pending(self) -> dict[int, dict[str, Any]]:
        """:meth:`PendingEntries.entries`."""
        return self._pending.entries()

    def held_depth(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` ``worker_id`` holds (0 if unknown)."""
        mine = self._blocks.get(worker_id)
        if not mine:
            return 0
        for i, h in enumerate(hashes):
            if h not in mine:
                return i
        return len(hashes)

    def route_lookup(self, hashes: Sequence[bytes]) -> dict[str, dict]:
        """What a router needs to place a prompt with block hashes ``hashes``.

        ``{"held": {worker: depth}, "pending": {worker: {"depth": d, "wait_tokens": t}},
        "backlog": {worker: tokens}}``: ``held`` is :meth:`lookup`; for each worker with a
        pending entry sharing leading blocks with ``hashes``, ``depth`` is the most leading
        blocks one of its entries covers and ``wait_tokens`` its pending tokens of the entries
        added up to and including the first such entry (a worker computes its prompts in
        order); ``backlog`` is each worker's pending tokens over all its entries and ``queued``
        how many entries it has (every router's prompts routed there and not yet computed).
        """
        return {
            "held": self.lookup(hashes),
            **self._pending.summary(hashes),
            "last_pending_id": self._pending.last_id,
        }

    # -- queries ---------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], exclude: str | None = None) -> dict[str, int]:
        """``{worker: n}``: the first ``n >= 1`` blocks of ``hashes`` are held by that worker.

        Workers holding none of the prefix are absent; ``exclude`` (the asking worker) is never
        answered. The walk stops at the first block no remaining candidate holds.
        """
        self._counts["lookups"] += 1
        if not hashes:
            return {}
        get = self._holders.get
        prev = get(hashes[0])
        if not prev:
            return {}
        alive = set(prev)
        if exclude is not None:
            alive.discard(exclude)
        if not alive:
            return {}
        depths: dict[str, int] = {}
        depth = len(hashes)
        # Invariant: alive <= prev. Interned holder sets make the common case, a chain held by
        # the same workers, one identity test per block; map() keeps the walk in C otherwise.
        for i, s in enumerate(map(get, islice(hashes, 1, None)), 1):
            if s is not prev:
                if s is None:
                    depth = i
                    break
                prev = s
                if not alive <= s:
                    for w in alive - s:
                        depths[w] = i
                    alive &= s
                    if not alive:
                        break
        for w in alive:
            depths[w] = depth
        return depths

    def holders(self, block_hash: bytes) -> set[str]:
        """The workers holding ``block_hash`` (a copy)."""
        return set(self._holders.get(block_hash, ()))

    def snapshot(self) -> dict[str, list[bytes]]:
        """Each registered worker's hashes, sorted."""
        return {w: sorted(self._blocks[w]) for w in self._workers}

    def stats(self) -> dict[str, int]:
        """Counters; ``events_applied`` counts block entries (a ``Cleared`` counts one)."""
        return {
            "blocks": len(self._holders),
            "entries": sum(map(len, self._blocks.values())),
            "workers": len(self._workers),
            "workers_needing_snapshot": sum(s.needs_snapshot for s in self._workers.values()),
            "pending": len(self._pending),
            **self._counts,
            **self._pending.counts,
        }

    def check_integrity(self) -> None:
        """Assert that ``hash -> workers`` and ``worker -> hashes`` mirror each other."""
        assert set(self._blocks) == set(self._workers), "blocks and workers disagree"
        entries = 0
        for h, ws in self._holders.items():
            assert ws, f"empty holder set for {h.hex()}"
            for w in ws:
                assert h in self._blocks[w], f"{w} listed as holder of {h.hex()} but lacks it"
            entries += len(ws)
        assert entries == sum(map(len, self._blocks.values())), "a worker holds an unlisted hash"
        self._pending.check_integrity()
