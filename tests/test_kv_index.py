"""KvIndex and the event schema: exact lookup depths, whole-or-nothing batches, gap recovery."""

from __future__ import annotations

from collections.abc import Sequence

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.connector.events import (
    SCHEMA_VERSION,
    Cleared,
    EventBatch,
    EventPublisher,
    MalformedBatch,
    Removed,
    Stored,
    decode_batch,
    encode_batch,
)
from kvmesh.connector.kv_index import KvIndex
from kvmesh.connector.pending_entries import RACE_WINDOW_S

FP = "fp-test"


def chain(root: bytes, n: int, branch: int = 0) -> list[bytes]:
    """``n`` chained 16-byte hashes under ``root``; another ``branch`` gives another chain."""
    out, parent = [], root
    for i in range(n):
        parent = xxhash.xxh3_128_digest(parent + bytes([branch, i]))
        out.append(parent)
    return out


BASE = chain(b"root", 12)
FORK4 = BASE[:4] + chain(BASE[3], 8, branch=1)  # shares 4 blocks with BASE
FORK8 = BASE[:8] + chain(BASE[7], 4, branch=2)  # shares 8 blocks with BASE


def batch(w: str, seq: int, *events) -> bytes:
    return encode_batch(EventBatch(w, seq, tuple(events)))


class Index(KvIndex):
    """A KvIndex whose calls carry each worker's own token, as its connector's do (these tests
    are about events; tokens are tested in test_peer_hardening.py)."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.tokens: dict[str, str] = {}

    def register(self, worker_id, fingerprint, metadata=None, token=None) -> str:
        token = super().register(worker_id, fingerprint, metadata, self.tokens.get(worker_id))
        self.tokens[worker_id] = token
        return token

    def apply(self, data, token=None):
        return super().apply(data, self.tokens)

    def apply_snapshot(self, worker_id, hashes, next_seq, token=None, tiers=None) -> None:
        super().apply_snapshot(worker_id, hashes, next_seq, self.tokens.get(worker_id), tiers)


def index_with(**held: list[bytes]) -> KvIndex:
    """An index where each keyword worker holds the given hashes (one Stored each)."""
    idx = Index(FP)
    for w, hashes in held.items():
        idx.register(w, FP)
        assert idx.apply(batch(w, 0, Stored(tuple(hashes)))).status == "applied"
    return idx


class CountingSeq(Sequence):
    """A read-only sequence that records which indexes were read."""

    def __init__(self, items: list[bytes]) -> None:
        self.items = items
        self.read: set[int] = set()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):
        self.read.add(i)
        return self.items[i]


def test_lookup_depths_with_shared_prefixes() -> None:
    idx = index_with(a=BASE[:10], b=FORK4, c=FORK8, d=BASE[:2], e=chain(b"other", 5))
    assert idx.lookup(BASE) == {"a": 10, "b": 4, "c": 8, "d": 2}
    assert idx.lookup(FORK8) == {"a": 8, "b": 4, "c": 12, "d": 2}
    assert idx.lookup(BASE[:3]) == {"a": 3, "b": 3, "c": 3, "d": 2}
    assert idx.lookup([]) == {} and idx.lookup(chain(b"nobody", 3)) == {}
    assert idx.holders(BASE[1]) == {"a", "b", "c", "d"} and idx.holders(BASE[9]) == {"a"}
    idx.check_integrity()


def test_lookup_is_a_prefix_match_and_exclude() -> None:
    holey = [h for i, h in enumerate(BASE) if i != 3]  # holds blocks 4.. but not 3
    idx = index_with(a=holey, b=BASE[:6])
    assert idx.lookup(BASE) == {"a": 3, "b": 6}
    assert idx.lookup(BASE, exclude="b") == {"a": 3}
    assert idx.lookup(BASE, exclude="a") == {"b": 6}
    assert idx.lookup(BASE, exclude="zzz") == {"a": 3, "b": 6}


def test_lookup_stops_at_first_block_nobody_left_holds() -> None:
    idx = index_with(a=BASE[:3], b=BASE[:5])
    query = CountingSeq(BASE)
    assert idx.lookup(query) == {"a": 3, "b": 5}
    assert max(query.read) == 5  # read block 5 (missed by all), nothing after it
    query = CountingSeq(BASE)
    assert idx.lookup(query, exclude="b") == {"a": 3}
    assert max(query.read) == 3


def test_roundtrip_and_stored_removed_cleared_semantics() -> None:
    b = EventBatch("a", 7, (Stored(tuple(BASE[:2]), None), Removed((BASE[0],)), Cleared()))
    assert decode_batch(encode_batch(b)) == b
    idx = index_with(a=BASE[:4])
    assert idx.apply(batch("a", 1, Stored(tuple(BASE[:6])))).status == "applied"  # idempotent
    assert idx.lookup(BASE) == {"a": 6}
    assert idx.apply(batch("a", 2, Removed((BASE[2], FORK4[5])))).status == "applied"
    assert idx.lookup(BASE) == {"a": 2} and idx.stats()["removes_ignored"] == 1
    assert idx.apply(batch("a", 3, Cleared(), Stored((BASE[0],)))).status == "applied"
    assert idx.snapshot() == {"a": [BASE[0]]}
    assert idx.stats()["events_applied"] == 4 + 6 + 2 + 1 + 1
    idx.check_integrity()


def pack(*obj) -> bytes:
    return msgpack.packb(list(obj), use_bin_type=True)


GOOD = [1, [BASE[0]], None, 0]  # Stored, device
MALFORMED = {
    "not msgpack": b"\xc1\xff",
    "truncated": batch("a", 1, Stored(tuple(BASE)))[:-3],
    "trailing bytes": batch("a", 1, Stored((BASE[0],))) + b"\x00",
    "not bytes": bytearray(batch("a", 1, Cleared())),
    "a map": msgpack.packb({"v": 1}),
    "three fields": pack(SCHEMA_VERSION, "a", 1),
    "wrong version": pack(SCHEMA_VERSION + 1, "a", 1, [GOOD]),
    "version as bool": pack(True, "a", 1, [GOOD]),
    "worker id int": pack(SCHEMA_VERSION, 5, 1, [GOOD]),
    "worker id bytes": pack(SCHEMA_VERSION, b"a", 1, [GOOD]),
    "seq str": pack(SCHEMA_VERSION, "a", "1", [GOOD]),
    "seq negative": pack(SCHEMA_VERSION, "a", -1, [GOOD]),
    "seq float": pack(SCHEMA_VERSION, "a", 1.0, [GOOD]),
    "events not list": pack(SCHEMA_VERSION, "a", 1, GOOD),
    "unknown kind": pack(SCHEMA_VERSION, "a", 1, [GOOD, [9, [BASE[1]], 0]]),
    "short hash": pack(SCHEMA_VERSION, "a", 1, [GOOD, [1, [BASE[1], BASE[2][:15]], None, 0]]),
    "str hash": pack(SCHEMA_VERSION, "a", 1, [[2, ["x" * 16], 0]]),
    "empty hashes": pack(SCHEMA_VERSION, "a", 1, [[1, [], None, 0]]),
    "short parent": pack(SCHEMA_VERSION, "a", 1, [[1, [BASE[1]], b"x", 0]]),
    "extra field": pack(SCHEMA_VERSION, "a", 1, [[3, 0, None]]),
    "event not list": pack(SCHEMA_VERSION, "a", 1, [GOOD, 3]),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_malformed_batch_is_rejected_whole_and_counted(name: str) -> None:
    idx = index_with(a=BASE[:2], b=FORK4[:5])
    before = idx.snapshot()
    with pytest.raises(MalformedBatch):
        decode_batch(MALFORMED[name])
    result = idx.apply(MALFORMED[name])
    assert result.status == "rejected" and result.reason
    assert idx.snapshot() == before and idx.stats()["batches_rejected"] == 1
    assert not idx.needs_snapshot("a")
    assert idx.apply(batch("a", 1, Stored((BASE[2],), BASE[1]))).status == "applied"


def test_duplicate_batch_is_ignored() -> None:
    idx = index_with(a=BASE[:2])
    data = batch("a", 1, Removed((BASE[1],)))
    assert idx.apply(data).status == "applied"
    assert idx.apply(batch("a", 1, Stored(tuple(BASE)))).status == "duplicate"
    assert idx.apply(data).status == "duplicate"
    assert idx.snapshot() == {"a": [BASE[0]]} and idx.stats()["duplicates"] == 2


def test_gap_freezes_worker_until_snapshot() -> None:
    idx = index_with(a=BASE[:2], b=BASE[:3])
    assert idx.apply(batch("a", 2, Stored((BASE[5],)))).status == "gap"
    assert idx.needs_snapshot("a") and not idx.needs_snapshot("b")
    # The late batch 1 is refused too: the index cannot know what else was lost.
    assert idx.apply(batch("a", 1, Stored((BASE[2],)))).status == "gap"
    assert idx.snapshot()["a"] == sorted(BASE[:2]) and idx.stats()["gaps"] == 2
    idx.apply_snapshot("a", FORK4[:6], next_seq=3)
    assert not idx.needs_snapshot("a")
    assert idx.lookup(FORK4) == {"a": 6, "b": 3}
    assert idx.apply(batch("a", 2, Cleared())).status == "duplicate"
    assert idx.apply(batch("a", 3, Removed((FORK4[4],)))).status == "applied"
    assert idx.lookup(FORK4) == {"a": 4, "b": 3}
    with pytest.raises(ValueError):
        idx.apply_snapshot("a", [b"short"], 4)
    idx.check_integrity()


def test_unknown_worker_and_other_fingerprint_refused() -> None:
    idx = index_with(a=BASE[:2])
    result = idx.apply(batch("ghost", 0, Stored((BASE[0],))))
    assert result.status == "rejected" and "ghost" in (result.reason or "")
    assert idx.stats()["batches_rejected"] == 1 and idx.holders(BASE[0]) == {"a"}
    with pytest.raises(ValueError, match=r"fp-other.*fp-test"):
        idx.register("b", "fp-other")
    with pytest.raises(ValueError, match="fp-other"):
        idx.register("a", "fp-other")
    assert set(idx.workers()) == {"a"} and idx.snapshot()["a"] == sorted(BASE[:2])


def test_reregister_starts_a_new_incarnation() -> None:
    idx = index_with(a=BASE[:4])
    idx.register("a", FP, {"node": "n2"})
    assert idx.snapshot() == {"a": []} and idx.workers() == {"a": {"node": "n2"}}
    assert idx.apply(batch("a", 0, Stored((BASE[0],)))).status == "applied"


def test_purge_removes_exactly_that_worker() -> None:
    idx = index_with(a=BASE, b=FORK8, c=FORK4)
    before = idx.snapshot()
    assert idx.purge("b") and not idx.purge("b")
    assert idx.lookup(FORK8) == {"a": 8, "c": 4}
    assert idx.snapshot() == {w: before[w] for w in ("a", "c")}
    assert all(idx.holders(h) == set() for h in FORK8[8:])
    assert idx.stats()["blocks"] == len(set(BASE) | set(FORK4))
    idx.check_integrity()


def test_publisher_numbers_coalesces_and_splits() -> None:
    pub = EventPublisher("a", max_blocks_per_batch=5)
    assert pub.drain() is None
    pub.on_store(BASE[:3], None)
    pub.on_store(BASE[3:8], BASE[2])  # continues the chain: coalesced
    pub.on_remove([FORK4[5]])
    pub.on_remove([FORK4[6]])
    got = []
    while (data := pub.drain()) is not None:
        got.append(decode_batch(data))
    assert [b.seq for b in got] == [0, 1]
    assert got[0].events == (Stored(tuple(BASE[:5]), None),)
    assert got[1].events == (Stored(tuple(BASE[5:8]), BASE[4]), Removed(tuple(FORK4[5:7])))
    pub.on_store(BASE[:2], None)
    pub.on_clear()  # what came before is moot
    assert decode_batch(pub.drain() or b"").events == (Cleared(),)
    pub.on_store(BASE[:2], None)
    assert pub.reset_for_snapshot() == 3 and pub.drain() is None
    with pytest.raises(ValueError, match="15 bytes"):
        pub.on_store([BASE[0][:15]], None)


# -- pending entries: prompts being computed now, shared routing state -----------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


FORK8_OTHER_ROOT = chain(b"another prompt", 4)


def test_a_raced_pending_entry_is_refused() -> None:
    """Two routers look up the same prompt before either records it: the second one's entry
    is refused (it must decide again and see the first), unless on the same worker or for
    another prompt."""
    idx = index_with(a=BASE[:1])
    seen = idx.route_lookup(BASE)["last_pending_id"]
    first = idx.add_pending("a", BASE, 10, seen=seen)
    assert first is not None
    assert idx.add_pending("b", BASE[:5], 10, seen=seen) is None  # raced by a's entry
    assert idx.stats()["pending_raced"] == 1
    assert idx.add_pending("a", BASE, 10, seen=seen) is not None  # same worker: no race
    assert idx.add_pending("b", FORK8_OTHER_ROOT, 10, seen=seen) is not None  # other prompt
    fresh = idx.route_lookup(BASE)
    assert fresh["pending"]["a"]["depth"] == len(BASE)
    assert idx.add_pending("b", BASE, 10, seen=fresh["last_pending_id"]) is not None


def test_an_entry_stored_between_lookup_and_claim_raced_it() -> None:
    """The other router's prompt was recorded *and* computed (its entry ended by the Stored
    event) between this router's lookup and its claim: still a race, or both workers compute
    the prefix (a two-ingress burst did). Past ``RACE_WINDOW_S`` the ended entry is forgotten."""
    clock = FakeClock()
    idx = Index(FP, clock=clock)
    for w in ("a", "b"):
        idx.register(w, FP)
    seen = idx.route_lookup(BASE)["last_pending_id"]
    assert idx.add_pending("a", BASE, 10, seen=seen) is not None
    assert idx.apply(batch("a", 0, Stored(tuple(BASE)))).status == "applied"
    assert idx.pending() == {}  # stored: the entry ended
    assert idx.add_pending("b", BASE, 10, seen=seen) is None
    clock.now += RACE_WINDOW_S + 1
    assert idx.add_pending("b", BASE, 10, seen=seen) is not None


def test_pending_lookup_depth_wait_tokens_and_backlog() -> None:
    idx = index_with(a=BASE[:3], b=FORK4[:2])
    p1 = idx.add_pending("a", FORK8[:6], 100)  # a computes FORK8's first 6 blocks first,
    p2 = idx.add_pending("a", BASE[:10], 40)  # then BASE's (shares 8 blocks with FORK8)
    p3 = idx.add_pending("b", FORK4, 7)
    p4 = idx.add_pending("c", chain(b"other", 3), 5)  # not registered: accepted
    assert len({p1, p2, p3, p4}) == 4
    got = idx.route_lookup(BASE)
    assert got["held"] == {"a": 3, "b": 2} and got["tiers"] == {}  # no tiers: all in held
    # a: p1 shares 6 blocks (wait 100); p2 shares 10 (wait 100 + 40): the deepest wins.
    assert got["pending"] == {
        "a": {"depth": 10, "wait_tokens": 140},
        "b": {"depth": 4, "wait_tokens": 7},
    }
    assert got["backlog"] == {"a": 140, "b": 7, "c": 5}
    # Equal depth: the earliest entry (least to wait for), as the frontend computes it.
    assert idx.route_lookup(FORK8[:5])["pending"]["a"] == {"depth": 5, "wait_tokens": 100}
    assert idx.pending_depth("a", FORK8) == 8 and idx.pending_depth("zzz", FORK8) == 0
    assert idx.route_lookup([]) == {
        "held": {},
        "tiers": {},
        "pending": {},
        "backlog": got["backlog"],
        "queued": {"a": 2, "b": 1, "c": 1},
        "last_pending_id": p4,
    }
    assert idx.drop_pending(p2) and not idx.drop_pending(p2) and not idx.drop_pending(999)
    got = idx.route_lookup(BASE)
    assert got["pending"]["a"] == {"depth": 6, "wait_tokens": 100}  # p1: FORK8[:6] = BASE[:6]
    assert got["backlog"]["a"] == 100
    assert idx.stats()["pending"] == 3
    idx.check_integrity()
    empty = idx.add_pending("a", [], 3)  # shorter than a block: only backlog
    assert idx.route_lookup(BASE)["backlog"]["a"] == 103 and idx.drop_pending(empty)
    for bad in [("", BASE, 1), ("a", [b"short"], 1), ("a", BASE, -1), ("a", BASE, 1.5)]:
        with pytest.raises(ValueError):
            idx.add_pending(*bad)
    with pytest.raises(ValueError):
        idx.add_pending("a", BASE, 1, ttl_s=0)
    idx.check_integrity()


def test_pending_expires_on_the_injected_clock() -> None:
    clock = FakeClock()
    idx = Index(FP, clock=clock)
    short = idx.add_pending("a", BASE[:4], 10, ttl_s=5)
    idx.add_pending("a", FORK4[:6], 20, ttl_s=30)
    assert idx.next_pending_expiry() == 1005.0
    clock.now = 1004.9
    assert idx.route_lookup(BASE)["pending"] == {"a": {"depth": 4, "wait_tokens": 10}}
    clock.now = 1005.0  # the short one is gone: only FORK4's entry (20 tokens) is left
    assert idx.route_lookup(BASE)["pending"] == {"a": {"depth": 4, "wait_tokens": 20}}
    assert idx.route_lookup(BASE)["backlog"] == {"a": 20}
    assert not idx.drop_pending(short) and idx.next_pending_expiry() == 1030.0
    clock.now = 2000.0
    assert idx.expire_pending() == 1 and idx.route_lookup(BASE)["backlog"] == {}
    assert idx.next_pending_expiry() is None
    assert idx.stats()["pending_expired"] == 2 and idx.stats()["pending"] == 0
    idx.check_integrity()


def test_pending_dropped_when_its_worker_stores_the_last_block() -> None:
    idx = index_with(a=[BASE[11]], b=[BASE[11]])
    pa = idx.add_pending("a", BASE[:6], 24)
    pb = idx.add_pending("b", BASE[:6], 24)
    other = idx.add_pending("a", BASE[:9], 36)
    # Part of the chain is no completion; the last block from *another* worker is not either.
    assert idx.apply(batch("a", 1, Stored(tuple(BASE[:5])))).status == "applied"
    assert idx.apply(batch("b", 1, Stored((BASE[8],)))).status == "applied"
    assert set(idx.pending()) == {pa, pb, other}
    assert idx.apply(batch("a", 2, Stored(tuple(BASE[5:7]), BASE[4]))).status == "applied"
    assert set(idx.pending()) == {pb, other}  # a stored BASE[5], pa's last block
    # A snapshot that holds the last block completes an entry too.
    idx.apply_snapshot("b", BASE[:6], next_seq=2)
    assert set(idx.pending()) == {other}
    assert idx.stats()["pending_stored"] == 2
    assert idx.route_lookup(BASE)["pending"] == {"a": {"depth": 9, "wait_tokens": 36}}
    idx.check_integrity()


def test_pending_dropped_when_its_worker_is_purged() -> None:
    idx = index_with(a=BASE[:2], b=BASE[:1])
    idx.add_pending("a", BASE, 10)
    idx.add_pending("a", FORK4, 10)
    kept = idx.add_pending("b", BASE, 10)
    idx.register("a", FP)  # a re-registers (e.g. after a gap): its prompts are still running
    assert len(idx.pending()) == 3
    assert idx.purge("a")
    assert set(idx.pending()) == {kept} and idx.route_lookup(BASE)["backlog"] == {"b": 10}
    assert not idx.purge("ghost")
    ghost = idx.add_pending("ghost", BASE, 1)  # never registered: a purge still drops it
    assert not idx.purge("ghost") and ghost not in idx.pending()
    idx.check_integrity()


# -- the index against a trivially correct model, under lossy delivery ----------------------

CHAINS = [BASE, FORK4, FORK8, chain(b"x", 6)]
WORKERS = ["w0", "w1", "w2"]
op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.integers(0, 11), st.integers(1, 6)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.integers(0, 11), st.integers(1, 3)),
    st.tuples(st.sampled_from(["clear", "flush", "drop", "dup", "swap", "snap", "purge"])),
)


def model_lookup(held: dict[str, set[bytes]], q: list[bytes], exclude=None) -> dict[str, int]:
    out = {}
    for w, s in held.items():
        n = 0
        while n < len(q) and q[n] in s:
            n += 1
        if n and w != exclude:
            out[w] = n
    return out


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(WORKERS), op), max_size=60))
def test_index_matches_model_under_random_lossy_delivery(ops) -> None:
    idx = Index(FP)
    truth = {w: set() for w in WORKERS}  # what each worker really holds
    pubs = {w: EventPublisher(w, max_blocks_per_batch=4) for w in WORKERS}
    last = {}
    for w in WORKERS:
        idx.register(w, FP)
    for w, (kind, *args) in ops:
        pub = pubs[w]
        if kind == "store":
            c, start, n = CHAINS[args[0]], min(args[1], 5), args[2]
            pub.on_store(c[start : start + n], c[start - 1] if start else None)
            truth[w].update(c[start : start + n])
        elif kind == "remove":
            gone = CHAINS[args[0]][args[1] : args[1] + args[2]]
            pub.on_remove(gone)
            truth[w].difference_update(gone)
        elif kind == "clear":
            pub.on_clear()
            truth[w].clear()
        elif kind in ("flush", "drop", "dup", "swap"):
            out = [d for d in (pub.drain(), pub.drain()) if d is not None]
            if kind == "swap":
                out.reverse()
            elif kind == "drop":
                out = out[1:]
            elif kind == "dup" and w in last:
                out.insert(0, last[w])
            for data in out:
                assert idx.apply(data).status != "rejected"
                last[w] = data
        elif kind == "snap" and idx.needs_snapshot(w):
            idx.apply_snapshot(w, truth[w], pub.reset_for_snapshot())
        elif kind == "purge":
            idx.purge(w)
            idx.register(w, FP)
            pubs[w] = EventPublisher(w, max_blocks_per_batch=4)
            truth[w].clear()
            last.pop(w, None)  # a previous incarnation's batch would be mistaken for new
        idx.check_integrity()
        held = {v: set(hs) for v, hs in idx.snapshot().items()}
        for q in CHAINS:
            assert idx.lookup(q, exclude="w1") == model_lookup(held, q, exclude="w1")
    # Reconcile as the connector would: deliver everything, then one more batch so a lost
    # last batch shows as a gap, then snapshot whoever needs one.
    for w in WORKERS:
        pubs[w].on_store([xxhash.xxh3_128_digest(w.encode())], None)
        truth[w].add(xxhash.xxh3_128_digest(w.encode()))
        while (data := pubs[w].drain()) is not None:
            idx.apply(data)
        if idx.needs_snapshot(w):
            idx.apply_snapshot(w, truth[w], pubs[w].reset_for_snapshot())
    assert idx.snapshot() == {w: sorted(s) for w, s in truth.items()}
    for q in CHAINS:
        assert idx.lookup(q) == model_lookup(truth, q)
    idx.check_integrity()
