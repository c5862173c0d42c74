"""KvIndex and the event schema: exact lookup depths, whole-or-nothing batches, gap recovery."""

from __future__ import annotations

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
from tests.kv_index_helpers import (
    BASE,
    FORK4,
    FORK8,
    FP,
    CountingSeq,
    Index,
    batch,
    chain,
    index_with,
    model_lookup,
    pack,
)


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


# -- the index against a trivially correct model, under lossy delivery ----------------------

CHAINS = [BASE, FORK4, FORK8, chain(b"x", 6)]
WORKERS = ["w0", "w1", "w2"]
op = st.one_of(
    st.tuples(st.just("store"), st.integers(0, 3), st.integers(0, 11), st.integers(1, 6)),
    st.tuples(st.just("remove"), st.integers(0, 3), st.integers(0, 11), st.integers(1, 3)),
    st.tuples(st.sampled_from(["clear", "flush", "drop", "dup", "swap", "snap", "purge"])),
)


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
