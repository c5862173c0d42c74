"""``HolderSets``: which workers hold which blocks, in one medium (device pool, host, disk).

Two mirrored maps, ``hash -> frozenset of workers`` and ``worker -> set of hashes``, and the
longest-prefix walk over them. ``KvIndex`` (connector/kv_index.py) keeps one per medium and does
the sequencing, tokens and pending entries; this class does only the sets.

Holder sets are interned frozensets: the many blocks of a chain held by the same workers share
one object (memory), and a lookup skips a block whose holder set *is* the previous one. The
transition caches are only an optimisation, so they are simply dropped when they grow.

No torch, no ray. Not thread-safe: the index actor holds a lock around its index.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from itertools import islice

_MAX_INTERNED = 1 << 16
_EMPTY: frozenset[bytes] = frozenset()


class HolderSets:
    """The blocks of one medium: ``hash -> workers`` and ``worker -> hashes``, kept mirrored.

    A worker has an entry (maybe empty) from :meth:`reset_worker` until :meth:`drop_worker`;
    the other mutators take only workers that have one (KeyError otherwise).
    """

    def __init__(self) -> None:
        self._holders: dict[bytes, frozenset[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}
        self._single: dict[str, frozenset[str]] = {}
        self._with: dict[tuple[frozenset[str], str], frozenset[str]] = {}
        self._without: dict[tuple[frozenset[str], str], frozenset[str]] = {}
        self._sets: dict[frozenset[str], frozenset[str]] = {}

    # -- per worker --------------------------------------------------------------------------

    def reset_worker(self, worker_id: str) -> None:
        """Drop the worker's blocks, keeping (or creating) its empty entry."""
        if worker_id in self._blocks:
            self.clear(worker_id)
        else:
            self._blocks[worker_id] = set()

    def drop_worker(self, worker_id: str) -> None:
        """Forget the worker and its blocks, in O(its blocks); nothing if unknown."""
        if worker_id in self._blocks:
            self.clear(worker_id)
            del self._blocks[worker_id]
        self._single.pop(worker_id, None)

    def blocks(self, worker_id: str) -> Collection[bytes]:
        """The worker's hashes: the live set, not a copy (do not change it); empty if unknown."""
        return self._blocks.get(worker_id, _EMPTY)

    def store(self, worker_id: str, hashes: Iterable[bytes]) -> None:
        """Add ``hashes`` to the worker's blocks (those it holds already change nothing)."""
        self._add(worker_id, set(hashes).difference(self._blocks[worker_id]))

    def remove(self, worker_id: str, hashes: Collection[bytes]) -> int:
        """Remove ``hashes`` from the worker's blocks; returns how many it did not hold."""
        held = self._blocks[worker_id].intersection(hashes)
        self._remove(worker_id, held)
        return len(hashes) - len(held)

    def clear(self, worker_id: str) -> None:
        """Drop every block of the worker (it keeps its empty entry)."""
        mine = self._blocks[worker_id]
        if mine:
            self._remove(worker_id, list(mine))

    def replace(self, worker_id: str, new: set[bytes]) -> None:
        """Make the worker's blocks exactly ``new``, touching only the difference."""
        mine = self._blocks[worker_id]
        self._remove(worker_id, mine - new)
        self._add(worker_id, new - mine)

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

    # -- queries -----------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], exclude: str | None = None) -> dict[str, int]:
        """``{worker: n}``: the first ``n >= 1`` blocks of ``hashes`` are held by that worker.

        Workers holding none of the prefix are absent; ``exclude`` is never answered. The walk
        stops at the first block no remaining candidate holds.
        """
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

    def holders(self, block_hash: bytes) -> frozenset[str]:
        """The workers holding ``block_hash`` (immutable; empty when none)."""
        return self._holders.get(block_hash, frozenset())

    def held_depth(self, worker_id: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``hashes`` the worker holds (0 if unknown)."""
        mine = self._blocks.get(worker_id)
        if not mine:
            return 0
        for i, h in enumerate(hashes):
            if h not in mine:
                return i
        return len(hashes)

    def __len__(self) -> int:
        """Distinct hashes held by anyone."""
        return len(self._holders)

    def entries(self) -> int:
        """(worker, hash) pairs."""
        return sum(map(len, self._blocks.values()))

    def check_integrity(self, workers: Collection[str], what: str = "") -> None:
        """Assert that the two maps mirror each other and that ``workers`` have entries."""
        assert set(self._blocks) == set(workers), f"{what}: blocks and workers disagree"
        entries = 0
        for h, ws in self._holders.items():
            assert ws, f"{what}: empty holder set for {h.hex()}"
            for w in ws:
                assert h in self._blocks[w], f"{what}: {w} listed for {h.hex()} but lacks it"
            entries += len(ws)
        assert entries == self.entries(), f"{what}: a worker holds an unlisted hash"


def cumulative_depths(
    media: Mapping[str, HolderSets], hashes: Sequence[bytes], base: Mapping[str, int]
) -> dict[str, dict[str, int]]:
    """``{worker: {medium: depth}}`` over ``media`` in order (the first one the base, e.g. the
    device pool): the first ``depth`` blocks of ``hashes`` are each held by that worker in that
    medium or an earlier one, so the depths never decrease along ``media``.

    ``base``: the first medium's :meth:`HolderSets.lookup` of ``hashes``. Only workers whose
    other media reach further than the base are listed. Cheap: it walks only workers that hold
    ``hashes[0]`` somewhere and have blocks beyond the base, each from its base depth to its
    first block held in none of the media.
    """
    if not hashes:
        return {}
    names, sets = list(media), list(media.values())
    rest = sets[1:]
    n, out = len(hashes), {}
    for w in set(base).union(*(m.holders(hashes[0]) for m in rest)):
        if not any(m.blocks(w) for m in rest):
            continue  # nothing beyond the base
        held = [m.blocks(w) for m in sets]
        i, depths = base.get(w, 0), []
        for k, mine in enumerate(held):
            lower = held[:k]
            # Past the previous depth the next block is in no lower medium: ask this one first.
            while i < n and (hashes[i] in mine or any(hashes[i] in s for s in lower)):
                i += 1
            depths.append(i)
        if i > depths[0]:
            out[w] = dict(zip(names, depths, strict=True))
    return out


def pullable_depth(device_depth: int, tier_depths: Mapping[str, int]) -> int:
    """Leading blocks a peer can pull from one worker: those in its device pool or any of its
    tiers (``tier_depths``: :func:`cumulative_depths`' entry for it, whose last medium counts
    them all). A holder promotes tier blocks into its pool when a peer pins them, reading
    disk copies off its step thread first; routers charge that copy (``router.py``)."""
    return max([device_depth, *tier_depths.values()])


def pullable_depths(
    held: Mapping[str, int],
    tiers: Mapping[str, Mapping[str, int]],
    exclude: str | None = None,
) -> dict[str, int]:
    """``{worker: n >= 1}``: :func:`pullable_depth` of every worker in ``held`` (device pool
    depths) or ``tiers`` (:func:`cumulative_depths`), ``exclude`` left out."""
    out = {}
    for w in held.keys() | tiers.keys():
        depth = pullable_depth(held.get(w, 0), tiers.get(w, {}))
        if depth and w != exclude:
            out[w] = depth
    return out


def nearest_holder(
    depths: Mapping[str, int],
    node: str | None,
    nodes: Mapping[str, str | None],
    link_s: Callable[[str], float] | None = None,
) -> str | None:
    """The peer to pull from, given how many of the prompt's blocks each can give (``depths``,
    the puller left out): the deepest; among equals the cheapest link (``link_s``: a block's
    pull time from that peer, as measured), then one on the puller's own node (``node``;
    ``nodes``: each worker's), whose bytes never cross a network, then by name. The router
    and a worker that looks the index up itself pick alike."""
    ranked = [
        (d, -link_s(w) if link_s else 0.0, node is not None and nodes.get(w) == node, w)
        for w, d in depths.items()
        if d > 0
    ]
    return max(ranked)[3] if ranked else None
