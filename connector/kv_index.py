"""The cluster-wide KV block index: which worker holds which block where, fed by event batches.

``KvIndex`` maps ``hash -> workers`` and ``worker -> hashes`` once per medium (``MEDIA``: device
pool, host-memory tier, disk tier; connector/holder_sets.py). A lookup walks a request's chain
of block hashes and answers each worker's longest prefix in its device pool (the only medium
peers pull from); :meth:`KvIndex.tier_depths` how far its tiers reach beyond. Workers feed it
numbered batches (connector/events.py); a gap in a worker's numbering freezes that worker until
it sends a full snapshot. Answers are hints: a block can leave a worker right after a lookup.

It also keeps *pending* entries (connector/pending_entries.py), shared routing state: "worker w
is computing these leading blocks of a prompt now". A device ``Stored`` of an entry's last
block from its worker, or the worker's purge, ends it here. :meth:`KvIndex.route_lookup`
answers both, held blocks and pending ones, so several ingress replicas see each other's
in-flight prompts.

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
from typing import Any, Literal

from kvmesh.connector.events import (
    KIND_CLEARED,
    KIND_STORED,
    MEDIA,
    MalformedBatch,
    Record,
    decode_records,
    require_block_hashes,
)
from kvmesh.connector.holder_sets import HolderSets, cumulative_depths, pullable_depths
from kvmesh.connector.pending_entries import DEFAULT_PENDING_TTL_S, PendingEntries

ApplyStatus = Literal["applied", "duplicate", "gap", "rejected"]
TIER_MEDIA = MEDIA[1:]  # the media a snapshot's ``tiers`` name: all but the device pool

_COUNTERS = ("events_applied", "batches_applied", "batches_rejected", "duplicates", "gaps")
# unauthorized: calls and batches refused for a wrong or missing worker token
_COUNTERS += ("lookups", "removes_ignored", "unauthorized")


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
    - Each medium is its own set of blocks: an event changes only its own medium (``Cleared``
      too); a purge, a re-registration or a snapshot changes all of them.
    - ``Stored`` of a held hash is a no-op; ``Removed`` of a hash not held is ignored (counted).
    - :meth:`lookup` answers, per worker, the longest prefix of the chain in its device pool
      (peers pull only from device pools; so do :meth:`holders` and :meth:`held_depth`), and
      :meth:`tier_depths` how far its tiers extend it.
    - A pending entry lives until :meth:`drop_pending`, its ``ttl_s`` (on ``clock``), an applied
      device ``Stored`` (batch or snapshot) of its last hash by its worker, or its worker's
      purge. Pending entries of unregistered workers are accepted: an index that just restarted
      learns of its workers only as they rejoin.
    """

    def __init__(self, fingerprint: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.fingerprint = fingerprint
        self._clock = clock
        self._media = {m: HolderSets() for m in MEDIA}
        self._device = self._media["device"]
        self._workers: dict[str, _Worker] = {}
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

        A known ``worker_id`` is taken to be a new incarnation: its blocks (every medium's) are
        purged and its numbering restarts at 0 (had we kept them, a restarted publisher's
        batches would all look like duplicates; a live worker that merely re-registers gets a
        gap and a snapshot).
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
        for blocks in self._media.values():
            blocks.reset_worker(worker_id)
        new_token = secrets.token_hex(16)
        self._workers[worker_id] = _Worker(fingerprint, dict(metadata or {}), new_token)
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
        """Forget a worker, its blocks (every medium's) and its pending entries in O(its
        blocks); False if it was not registered."""
        self._pending.drop_worker(worker_id)
        for blocks in self._media.values():
            blocks.drop_worker(worker_id)
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
        self,
        worker_id: str,
        hashes: Iterable[bytes],
        next_seq: int,
        token: str | None,
        tiers: Mapping[str, Iterable[bytes]] | None = None,
    ) -> None:
        """Replace a worker's blocks wholesale, clear its gap, expect ``next_seq`` next.

        ``hashes`` are its device pool's blocks; ``tiers`` maps ``"host"`` and ``"disk"`` to its
        tiers' blocks. Wholesale means every medium: one missing from ``tiers`` (or ``tiers``
        None) is emptied. Raises KeyError for an unknown worker, PermissionError for a wrong
        token and ValueError for a bad hash, ``tiers`` key or ``next_seq``; on error nothing
        changes.
        """
        state = self._workers[worker_id]
        self.authorize(worker_id, token)
        tiers = {} if tiers is None else tiers
        if not isinstance(tiers, Mapping) or not set(tiers) <= set(TIER_MEDIA):
            raise ValueError(f"tiers must map {TIER_MEDIA} to hashes, got {tiers!r:.80}")
        new = {"device": set(hashes)}
        new.update((m, set(tiers.get(m, ()))) for m in TIER_MEDIA)
        for medium, blocks in new.items():
            require_block_hashes(blocks, f"snapshot {medium}")
        if type(next_seq) is not int or next_seq < 0:
            raise ValueError(f"next_seq must be a non-negative int, got {next_seq!r}")
        for medium, blocks in new.items():
            self._media[medium].replace(worker_id, blocks)
        state.expected_seq = next_seq
        state.needs_snapshot = False
        self._pending.stored(worker_id, new["device"])

    def _apply_records(self, worker_id: str, records: list[Record]) -> None:
        events = ignored = 0
        media = self._media
        for kind, hashes, _parent, medium in records:
            blocks = media[medium]
            if kind == KIND_STORED:
                blocks.store(worker_id, hashes)
                if blocks is self._device:
                    self._pending.stored(worker_id, hashes)
            elif kind == KIND_CLEARED:
                blocks.clear(worker_id)
            else:
                ignored += blocks.remove(worker_id, hashes)
            events += len(hashes) or 1
        self._counts["removes_ignored"] += ignored
        self._counts["events_applied"] += events

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

    def confirm_pending(
        self, worker_id: str, pending_id: int, hashes: Sequence[bytes], token: object
    ) -> bool:
        """:meth:`PendingEntries.confirm`, for the worker itself (PermissionError for a wrong
        token: a forged entry cannot be made to last)."""
        self.authorize(worker_id, token)
        return self._pending.confirm(pending_id, worker_id, hashes)

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
        """How many leading blocks of ``hashes`` ``worker_id`` holds in its device pool (0 if
        unknown)."""
        return self._device.held_depth(worker_id, hashes)

    def route_lookup(self, hashes: Sequence[bytes]) -> dict[str, dict]:
        """What a router needs to place a prompt with block hashes ``hashes``.

        ``{"held": {worker: depth}, "tiers": {worker: {"device": d0, "host": d1, "disk": d2}},
        "pending": {worker: {"depth": d, "wait_tokens": t}}, "backlog": {worker: tokens},
        "queued": {worker: n}, "last_pending_id": id, "nodes": {worker: node}}``: ``held`` is
        :meth:`lookup` (device pools), ``tiers`` :meth:`tier_depths`; for each worker with a
        pending entry sharing
        leading blocks with ``hashes``, ``depth`` is the most leading blocks one of its entries
        covers and ``wait_tokens`` its pending tokens of the entries added up to and including
        the first such entry (a worker computes its prompts in order); ``backlog`` is each
        worker's pending tokens over all its entries and ``queued`` how many entries it has
        (every router's prompts routed there and not yet computed); ``nodes`` the node each
        registered worker's KV lives on (its registration's ``node``; None if it gave none).
        """
        held = self.lookup(hashes)
        return {
            "held": held,
            "tiers": cumulative_depths(self._media, hashes, held),
            **self._pending.summary(hashes),
            "last_pending_id": self._pending.last_id,
            "nodes": {w: s.metadata.get("node") for w, s in self._workers.items()},
        }

    # -- queries ---------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], exclude: str | None = None) -> dict[str, int]:
        """``{worker: n}``: the first ``n >= 1`` blocks of ``hashes`` are in that worker's device
        pool. Workers holding none of the prefix are absent; ``exclude`` (the asking worker) is
        never answered. The walk stops at the first block no remaining candidate holds."""
        self._counts["lookups"] += 1
        return self._device.lookup(hashes, exclude)

    def pull_depths(self, hashes: Sequence[bytes], exclude: str | None = None) -> dict[str, int]:
        """``{worker: n}``: what a peer can pull from that worker, the first ``n >= 1`` blocks
        of ``hashes`` (:func:`pullable_depth`). :meth:`lookup`'s rules otherwise."""
        self._counts["lookups"] += 1
        held = self._device.lookup(hashes, exclude)
        return pullable_depths(held, cumulative_depths(self._media, hashes, held), exclude)

    def tier_depths(self, hashes: Sequence[bytes]) -> dict[str, dict[str, int]]:
        """``{worker: {"device": d0, "host": d1, "disk": d2}}``, cumulative leading depths: the
        first ``d0`` blocks of ``hashes`` are in that worker's device pool, the first ``d1`` in
        its pool or host tier, the first ``d2`` in any medium (``d0 <= d1 <= d2``). Only workers
        whose tiers reach further than their pool (``d2 > d0``) are listed; :meth:`lookup`
        describes the others fully. See :func:`cumulative_depths` for the cost."""
        return cumulative_depths(self._media, hashes, self._device.lookup(hashes))

    def holders(self, block_hash: bytes) -> set[str]:
        """The workers holding ``block_hash`` in their device pool (a copy)."""
        return set(self._device.holders(block_hash))

    def snapshot(self) -> dict[str, list[bytes]]:
        """Each registered worker's device hashes, sorted."""
        return {w: sorted(self._device.blocks(w)) for w in self._workers}

    def snapshot_media(self) -> dict[str, dict[str, list[bytes]]]:
        """Each registered worker's hashes per medium, sorted: ``{worker: {medium: [...]}}``."""
        return {w: {m: sorted(b.blocks(w)) for m, b in self._media.items()} for w in self._workers}

    def stats(self) -> dict[str, int]:
        """Counters; ``events_applied`` counts block entries (a ``Cleared`` counts one).

        ``blocks`` (distinct hashes) and ``entries`` ((worker, hash) pairs) count device pools;
        ``host_blocks`` / ``host_entries`` and ``disk_blocks`` / ``disk_entries`` the tiers.
        """
        tiers = {f"{m}_blocks": len(self._media[m]) for m in TIER_MEDIA}
        tiers.update((f"{m}_entries", self._media[m].entries()) for m in TIER_MEDIA)
        return {
            "blocks": len(self._device),
            "entries": self._device.entries(),
            **tiers,
            "workers": len(self._workers),
            "workers_needing_snapshot": sum(s.needs_snapshot for s in self._workers.values()),
            "pending": len(self._pending),
            **self._counts,
            **self._pending.counts,
        }

    def check_integrity(self) -> None:
        """Assert that, in every medium, ``hash -> workers`` and ``worker -> hashes`` mirror each
        other and cover exactly the registered workers."""
        for medium, blocks in self._media.items():
            blocks.check_integrity(self._workers, medium)
        self._pending.check_integrity()
