"""The KV event schema that workers publish to the cluster index, and the worker-side publisher.

A worker tells the index which blocks it holds, and in which medium (``MEDIA``: its device
pool, its host-memory tier, its disk tier), through numbered batches of events:
``Stored(hashes, parent, medium)`` (a chain of consecutive blocks entered that medium),
``Removed(hashes, medium)`` (blocks left it) and ``Cleared(medium)`` (everything left it). A
batch is the unit of delivery and of sequencing: ``seq`` counts the batches of one worker from
0, and the index applies a batch whole or not at all. The wire form is msgpack, laid out in
docs/events.md (a medium travels as its index in ``MEDIA``):

    [SCHEMA_VERSION, worker_id, seq, [event, ...]]
    event = [KIND_STORED, [hash, ...], parent | nil, medium]
          | [KIND_REMOVED, [hash, ...], medium]
          | [KIND_CLEARED, medium]

No torch, no ray: bytes in, bytes out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

SCHEMA_VERSION = 2  # bump on any change to the layout below; the index rejects other versions
HASH_LEN = 16  # a block hash is an xxh3-128 digest (workers/block_hash.py)

KIND_STORED = 1
KIND_REMOVED = 2
KIND_CLEARED = 3
_KIND_NAMES = {KIND_STORED: "Stored", KIND_REMOVED: "Removed", KIND_CLEARED: "Cleared"}
_KIND_FIELDS = {KIND_STORED: 4, KIND_REMOVED: 3, KIND_CLEARED: 2}  # medium last in each

# Where a worker holds a block: its device KV pool (the only medium peers pull from), its
# host-memory tier, its local-disk tier. On the wire a medium is its index here.
MEDIA = ("device", "host", "disk")
MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK = 0, 1, 2  # their indexes in MEDIA
MEDIUM_IDS = {name: i for i, name in enumerate(MEDIA)}  # name -> wire int; MEDIA[i] the reverse

_BYTES_ONLY = frozenset((bytes,))
_LEN_ONLY = frozenset((HASH_LEN,))

Record = tuple[int, list[bytes], bytes | None, str]
"""One validated event as :func:`decode_records` returns it: ``(kind, hashes, parent, medium)``,
``medium`` a name in ``MEDIA``, ``hashes`` empty for a ``Cleared`` and ``parent`` None but for a
``Stored``."""


class MalformedBatch(ValueError):
    """A batch that does not follow the schema; it is rejected whole, never half-applied."""


def _check_hashes(hashes: Any, what: str) -> None:
    """Raise MalformedBatch unless ``hashes`` is a non-empty list/tuple of 16-byte ``bytes``."""
    if type(hashes) not in (list, tuple) or not hashes:
        raise MalformedBatch(f"{what}: hashes must be a non-empty list, got {hashes!r:.60}")
    # The fast path checks all elements with two C-level passes; the slow path names the culprit.
    if {*map(type, hashes)} == _BYTES_ONLY and {*map(len, hashes)} == _LEN_ONLY:
        return
    for i, h in enumerate(hashes):
        if type(h) is not bytes:
            raise MalformedBatch(f"{what}: hash {i} is {type(h).__name__}, expected bytes")
        if len(h) != HASH_LEN:
            raise MalformedBatch(f"{what}: hash {i} is {len(h)} bytes, expected {HASH_LEN}")


def require_block_hashes(hashes: Iterable[bytes], what: str) -> None:
    """ValueError unless every hash is ``HASH_LEN`` bytes (for callers, not batches)."""
    bad = [h for h in hashes if type(h) is not bytes or len(h) != HASH_LEN]
    if bad:
        raise ValueError(f"{what} hashes must be {HASH_LEN} bytes, got {bad[0]!r:.60}")


def _check_parent(parent: Any, what: str) -> None:
    if parent is not None and (type(parent) is not bytes or len(parent) != HASH_LEN):
        raise MalformedBatch(f"{what}: parent must be nil or {HASH_LEN} bytes, got {parent!r:.60}")


def _check_medium(medium: Any, what: str) -> None:
    """Raise MalformedBatch unless ``medium`` is a name in ``MEDIA``."""
    if type(medium) is not str or medium not in MEDIUM_IDS:
        raise MalformedBatch(f"{what}: unknown medium {medium!r:.60}, expected one of {MEDIA}")


@dataclass(frozen=True)
class Stored:
    """``hashes`` (consecutive blocks, oldest first) entered the worker's ``medium``: its prefix
    cache (``"device"``) or one of its tiers (``"host"``, ``"disk"``).

    ``parent`` is the hash of the block before ``hashes[0]``, ``None`` at the root of a chain.
    Block hashes are chained, so a hash alone names its whole prefix; ``parent`` is carried for
    consumers that build trees and for debugging.
    """

    hashes: tuple[bytes, ...]
    parent: bytes | None = None
    medium: str = "device"

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "Stored")
        _check_parent(self.parent, "Stored")
        _check_medium(self.medium, "Stored")


@dataclass(frozen=True)
class Removed:
    """``hashes`` left the worker's ``medium`` (evicted, invalidated, moved to another)."""

    hashes: tuple[bytes, ...]
    medium: str = "device"

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "Removed")
        _check_medium(self.medium, "Removed")


@dataclass(frozen=True)
class Cleared:
    """Every block left the worker's ``medium`` (reset, weights reloaded, tier wiped)."""

    medium: str = "device"

    def __post_init__(self) -> None:
        _check_medium(self.medium, "Cleared")


Event = Stored | Removed | Cleared


@dataclass(frozen=True)
class EventBatch:
    """The unit of delivery: a worker's ``seq``-th batch (from 0, +1 per batch)."""

    worker_id: str
    seq: int
    events: tuple[Event, ...]


def _record(event: Event) -> list:
    if isinstance(event, Stored):
        return [KIND_STORED, list(event.hashes), event.parent, MEDIUM_IDS[event.medium]]
    if isinstance(event, Removed):
        return [KIND_REMOVED, list(event.hashes), MEDIUM_IDS[event.medium]]
    if isinstance(event, Cleared):
        return [KIND_CLEARED, MEDIUM_IDS[event.medium]]
    raise TypeError(f"not an event: {event!r}")


def _pack(worker_id: str, seq: int, records: list[list]) -> bytes:
    return msgpack.packb([SCHEMA_VERSION, worker_id, seq, records], use_bin_type=True)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack bytes of ``batch`` (see docs/events.md)."""
    return _pack(batch.worker_id, batch.seq, [_record(e) for e in batch.events])


def decode_records(data: bytes) -> tuple[str, int, list[Record]]:
    """Decode and fully validate a batch into ``(worker_id, seq, records)``: the fast path.

    Every field is checked before anything is returned (version, types, hash lengths, event
    kinds, media), so a caller that applies the records can never half-apply a bad batch. Raises
    :class:`MalformedBatch` naming the first problem found.
    """
    if type(data) is not bytes:
        raise MalformedBatch(f"a batch is bytes, got {type(data).__name__}")
    try:
        obj = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise MalformedBatch(f"not msgpack: {type(e).__name__}: {e}") from None
    if type(obj) is not list or len(obj) != 4:
        raise MalformedBatch("a batch is [version, worker_id, seq, events]")
    version, worker_id, seq, events = obj
    if type(version) is not int or version != SCHEMA_VERSION:
        raise MalformedBatch(f"schema version {version!r}, this index reads {SCHEMA_VERSION}")
    if type(worker_id) is not str or not worker_id:
        raise MalformedBatch(f"worker_id must be a non-empty str, got {worker_id!r:.60}")
    # `type(x) is int` also refuses bools, which msgpack decodes as a distinct type.
    if type(seq) is not int or seq < 0:
        raise MalformedBatch(f"seq must be a non-negative int, got {seq!r:.60}")
    if type(events) is not list:
        raise MalformedBatch(f"events must be a list, got {type(events).__name__}")
    records: list[Record] = []
    for i, ev in enumerate(events):
        if type(ev) is not list or not ev:
            raise MalformedBatch(f"event {i} must be a non-empty list, got {ev!r:.60}")
        kind = ev[0]
        if type(kind) is not int or kind not in _KIND_NAMES:
            raise MalformedBatch(f"event {i}: unknown kind {kind!r:.60}")
        what = f"event {i} ({_KIND_NAMES[kind]})"
        if len(ev) != _KIND_FIELDS[kind]:
            raise MalformedBatch(f"{what}: wrong number of fields ({len(ev)})")
        medium = ev[-1]
        # `type(...) is int` refuses bools; the range check refuses unknown media.
        if type(medium) is not int or not 0 <= medium < len(MEDIA):
            raise MalformedBatch(f"{what}: unknown medium {medium!r:.60}")
        if kind == KIND_STORED:
            _check_hashes(ev[1], what)
            _check_parent(ev[2], what)
            records.append((kind, ev[1], ev[2], MEDIA[medium]))
        elif kind == KIND_REMOVED:
            _check_hashes(ev[1], what)
            records.append((kind, ev[1], None, MEDIA[medium]))
        else:
            records.append((kind, [], None, MEDIA[medium]))
    return worker_id, seq, records


def decode_batch(data: bytes) -> EventBatch:
    """Decode and fully validate ``data``; raises :class:`MalformedBatch`, never half-parses."""
    worker_id, seq, records = decode_records(data)
    events: list[Event] = []
    for kind, hashes, parent, medium in records:
        if kind == KIND_STORED:
            events.append(Stored(tuple(hashes), parent, medium))
        elif kind == KIND_REMOVED:
            events.append(Removed(tuple(hashes), medium))
        else:
            events.append(Cleared(medium))
    return EventBatch(worker_id, seq, tuple(events))


def _validated(
    hashes: Sequence[bytes], parent: bytes | None, medium: str, what: str
) -> list[bytes]:
    """``hashes`` as a new list; ValueError for a bad hash, parent or medium (an empty list is
    fine)."""
    hashes = list(hashes)
    try:
        if hashes:
            _check_hashes(hashes, what)
        _check_parent(parent, what)
        _check_medium(medium, what)
    except MalformedBatch as e:
        raise ValueError(str(e)) from None
    return hashes


class EventPublisher:
    """Worker side: buffers prefix-cache and tier observations and hands out numbered, encoded
    batches.

    Contract: ``drain()`` returns batches with ``seq`` 0, 1, 2, ... and each must reach the index
    in that order (a lost or reordered batch shows up there as a gap, answered by a snapshot:
    :meth:`reset_for_snapshot`). A batch holds at most ``max_blocks_per_batch`` block entries (a
    ``Cleared`` counts one); longer events are split, a chain keeping its parent link. Events
    keep their order. Coalescing, only with the last buffered event and only of the same
    medium: a ``Stored`` that continues its chain extends it, and consecutive removes merge.
    Not thread-safe: call it under the worker's lock.
    """

    def __init__(self, worker_id: str, max_blocks_per_batch: int = 1024) -> None:
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")
        if max_blocks_per_batch < 1:
            raise ValueError(f"max_blocks_per_batch must be >= 1, got {max_blocks_per_batch}")
        self.worker_id = worker_id
        self.max_blocks_per_batch = max_blocks_per_batch
        self._next_seq = 0
        # Records [kind, hashes, parent, medium name], mutable so that later calls coalesce.
        self._pending: deque[list] = deque()

    @property
    def next_seq(self) -> int:
        """The ``seq`` the next drained batch will carry."""
        return self._next_seq

    @property
    def pending_blocks(self) -> int:
        """Block entries buffered and not yet drained (a ``Cleared`` counts one)."""
        return sum(max(1, len(r[1])) for r in self._pending)

    def on_store(
        self, hashes: Sequence[bytes], parent: bytes | None, medium: str = "device"
    ) -> None:
        """Buffer ``Stored(hashes, parent, medium)``; validated here (ValueError) so the index
        never rejects it."""
        hashes = _validated(hashes, parent, medium, "on_store")
        last = self._pending[-1] if self._pending else None
        continues = (
            last is not None
            and last[0] == KIND_STORED
            and last[3] == medium
            and last[1][-1] == parent
        )
        if continues:
            last[1].extend(hashes)
        elif hashes:
            self._pending.append([KIND_STORED, hashes, parent, medium])

    def on_remove(self, hashes: Sequence[bytes], medium: str = "device") -> None:
        """Buffer ``Removed(hashes, medium)``."""
        hashes = _validated(hashes, None, medium, "on_remove")
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == KIND_REMOVED and last[3] == medium:
            last[1].extend(hashes)
        elif hashes:
            self._pending.append([KIND_REMOVED, hashes, None, medium])

    def on_clear(self, medium: str = "device") -> None:
        """Buffer ``Cleared(medium)``; the buffered events of that medium before it are moot and
        dropped (those of other media stay, in order)."""
        _validated((), None, medium, "on_clear")
        kept = [r for r in self._pending if r[3] != medium]
        kept.append([KIND_CLEARED, [], None, medium])
        self._pending = deque(kept)

    def reset_for_snapshot(self) -> int:
        """Drop buffered events and return the ``next_seq`` to send with a snapshot.

        Call it in the same step as reading the pool's (and tiers') hashes: the snapshot then
        covers every event buffered or in flight, and those in flight arrive at the index as
        duplicates.
        """
        self._pending.clear()
        return self._next_seq

    def drain(self) -> bytes | None:
        """The next encoded batch, or ``None`` when nothing is buffered."""
        if not self._pending:
            return None
        budget = self.max_blocks_per_batch
        out: list[list] = []
        while self._pending and budget > 0:
            kind, hashes, parent, medium = self._pending[0]
            m = MEDIUM_IDS[medium]
            if kind == KIND_CLEARED:
                out.append([kind, m])
                budget -= 1
            elif len(hashes) <= budget:
                out.append([kind, hashes, parent, m] if kind == KIND_STORED else [kind, hashes, m])
                budget -= len(hashes)
            else:
                head, tail = hashes[:budget], hashes[budget:]
                out.append([kind, head, parent, m] if kind == KIND_STORED else [kind, head, m])
                # The rest of a chain continues from the last block sent.
                self._pending[0] = [kind, tail, head[-1] if kind == KIND_STORED else None, medium]
                break
            self._pending.popleft()
        data = _pack(self.worker_id, self._next_seq, out)
        self._next_seq += 1
        return data
