"""Media in the index: ``lookup`` answers device pools only, ``tier_depths`` the cumulative
depths per medium, snapshots replace every medium wholesale; a random model over 3 workers and
3 media checks it all together."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.connector.events import MEDIA, Cleared, EventPublisher, Removed, Stored
from kvmesh.connector.holder_sets import HolderSets
from tests.kv_index_helpers import (
    BASE,
    FORK4,
    FORK8,
    FP,
    CountingSeq,
    Index,
    batch,
    index_with,
    model_lookup,
)


def test_lookup_is_device_only_and_tier_depths_cumulative() -> None:
    idx = index_with(a=BASE[:6])
    for w in "bcdef":
        idx.register(w, FP)
    events = {
        "b": [Stored(tuple(BASE[:6]), None, "host")],  # the same blocks as a, in host
        # device 2, then host 2, then disk 2; a device block again after a hole
        "c": [
            Stored(tuple(BASE[:2])),
            Stored(tuple(BASE[2:4]), BASE[1], "host"),
            Stored(tuple(BASE[4:6]), BASE[3], "disk"),
            Stored((BASE[7],), BASE[6]),
        ],
        # device 1; block 1 only on disk, block 2 in host: host depth 1, disk depth 3
        "d": [
            Stored((BASE[0],)),
            Stored((BASE[1],), None, "disk"),
            Stored((BASE[2],), None, "host"),
        ],
        # tiers that do not continue its pool's prefix: fully described by lookup
        "e": [Stored(tuple(BASE[:3])), Stored(tuple(BASE[5:]), None, "host")],
        "f": [Stored(tuple(BASE[:4]), None, "disk")],  # disk only
    }
    for w, evs in events.items():
        assert idx.apply(batch(w, 0, *evs)).status == "applied"
    assert idx.lookup(BASE) == {"a": 6, "c": 2, "d": 1, "e": 3}
    assert idx.holders(BASE[0]) == {"a", "c", "d", "e"}
    tiers = idx.tier_depths(BASE)
    assert tiers == {
        "b": {"device": 0, "host": 6, "disk": 6},
        "c": {"device": 2, "host": 4, "disk": 6},
        "d": {"device": 1, "host": 1, "disk": 3},
        "f": {"device": 0, "host": 0, "disk": 4},
    }
    for w, d in tiers.items():
        assert d["device"] <= d["host"] <= d["disk"] and d["disk"] > d["device"]
        assert d["device"] == idx.lookup(BASE).get(w, 0)
    got = idx.route_lookup(BASE)
    assert got["held"] == idx.lookup(BASE) and got["tiers"] == tiers
    assert idx.tier_depths([]) == {} and idx.tier_depths(FORK4[4:]) == {}
    assert idx.tier_depths(BASE[:1]) == {
        "b": {"device": 0, "host": 1, "disk": 1},
        "f": {"device": 0, "host": 0, "disk": 1},
    }
    stats = idx.stats()
    assert (stats["blocks"], stats["entries"]) == (7, 6 + 3 + 1 + 3)
    assert (stats["host_blocks"], stats["host_entries"]) == (12, 6 + 2 + 1 + 7)
    assert (stats["disk_blocks"], stats["disk_entries"]) == (6, 2 + 1 + 4)
    idx.check_integrity()


def test_tier_depths_walks_little(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only workers with tier blocks that hold ``hashes[0]`` somewhere are walked, each up to
    its first block held nowhere."""
    idx = index_with(a=BASE, b=BASE[:4])  # device only: described by lookup, never walked
    for i in range(20):  # tiers, but not of this prompt's first block
        w = f"other{i}"
        idx.register(w, FP)
        evs = (Stored(tuple(FORK4[4:])), Stored(tuple(BASE[1:]), None, "host"))
        assert idx.apply(batch(w, 0, *evs)).status == "applied"
    idx.register("t", FP)
    assert idx.apply(batch("t", 0, Stored(tuple(BASE[:3]), None, "disk"))).status == "applied"
    asked = []
    blocks = HolderSets.blocks
    monkeypatch.setattr(HolderSets, "blocks", lambda self, w: asked.append(w) or blocks(self, w))
    q = CountingSeq(BASE[:6] + FORK4[6:])
    assert idx.tier_depths(q) == {"t": {"device": 0, "host": 0, "disk": 3}}
    assert set(asked) <= {"a", "b", "t"}
    assert max(q.read) == 6  # the device walk stops at block 6, a's first miss
    idx.purge("a")
    q = CountingSeq(BASE[:6] + FORK4[6:])
    assert idx.tier_depths(q) == {"t": {"device": 0, "host": 0, "disk": 3}}
    assert max(q.read) == 4  # b's device walk stops at block 4, t's tier walk at block 3
    assert set(asked) <= {"a", "b", "t"}


def test_a_block_moved_device_to_host_keeps_the_tier_depth() -> None:
    idx = index_with(a=BASE[:6])
    move = (Removed(tuple(BASE[3:6])), Stored(tuple(BASE[3:6]), BASE[2], "host"))
    assert idx.apply(batch("a", 1, *move)).status == "applied"
    assert idx.lookup(BASE) == {"a": 3}
    assert idx.tier_depths(BASE) == {"a": {"device": 3, "host": 6, "disk": 6}}
    down = (Removed(tuple(BASE[4:6]), "host"), Stored(tuple(BASE[4:6]), BASE[3], "disk"))
    assert idx.apply(batch("a", 2, *down)).status == "applied"
    assert idx.tier_depths(BASE) == {"a": {"device": 3, "host": 4, "disk": 6}}
    back = (Removed((BASE[3],), "host"), Stored((BASE[3],), BASE[2]))  # promoted again
    assert idx.apply(batch("a", 3, *back)).status == "applied"
    assert idx.lookup(BASE) == {"a": 4}
    assert idx.tier_depths(BASE) == {"a": {"device": 4, "host": 4, "disk": 6}}
    assert idx.stats()["removes_ignored"] == 0
    idx.check_integrity()


def test_cleared_drops_only_its_medium() -> None:
    idx = index_with(a=BASE[:2])
    tiers = (Stored(tuple(BASE[2:4]), BASE[1], "host"), Stored(tuple(BASE[4:6]), BASE[3], "disk"))
    assert idx.apply(batch("a", 1, *tiers)).status == "applied"
    assert idx.tier_depths(BASE) == {"a": {"device": 2, "host": 4, "disk": 6}}
    assert idx.apply(batch("a", 2, Cleared("host"))).status == "applied"
    assert idx.lookup(BASE) == {"a": 2}
    assert idx.snapshot_media()["a"] == {
        "device": sorted(BASE[:2]),
        "host": [],
        "disk": sorted(BASE[4:6]),
    }
    assert idx.tier_depths(BASE) == {}  # the disk blocks no longer continue the prefix
    assert idx.apply(batch("a", 3, Cleared())).status == "applied"  # device: disk stays
    assert idx.lookup(BASE) == {} and idx.stats()["disk_entries"] == 2
    assert idx.apply(batch("a", 4, Removed((BASE[0],), "disk"))).status == "applied"
    assert idx.stats()["removes_ignored"] == 1  # it is not on disk
    idx.check_integrity()


def test_purge_and_reregister_drop_every_medium() -> None:
    idx = index_with(a=BASE[:2], b=BASE[:2])
    for w in "ab":
        evs = (Stored(tuple(BASE[2:4]), BASE[1], "host"), Stored(tuple(BASE[4:6]), None, "disk"))
        assert idx.apply(batch(w, 1, *evs)).status == "applied"
    assert idx.purge("a")
    assert set(idx.tier_depths(BASE)) == {"b"}
    idx.register("b", FP)  # a new incarnation: nothing of the old one's, in any medium
    assert idx.tier_depths(BASE) == {} and idx.lookup(BASE) == {}
    stats = idx.stats()
    assert stats["entries"] == stats["host_entries"] == stats["disk_entries"] == 0
    assert stats["blocks"] == stats["host_blocks"] == stats["disk_blocks"] == 0
    assert idx.snapshot_media() == {"b": {m: [] for m in MEDIA}}
    idx.check_integrity()


def test_pending_entries_end_only_on_device_stores() -> None:
    idx = index_with(a=[FORK4[9]])
    entry = idx.add_pending("a", BASE[:4], 16)
    assert idx.apply(batch("a", 1, Stored(tuple(BASE[:4]), None, "host"))).status == "applied"
    idx.apply_snapshot("a", [FORK4[9]], 2, tiers={"disk": BASE[:4]})
    assert set(idx.pending()) == {entry}  # a tier holding the prompt is no completion
    assert idx.apply(batch("a", 2, Stored(tuple(BASE[:4])))).status == "applied"
    assert idx.pending() == {}


def test_snapshot_with_tiers_replaces_every_medium() -> None:
    idx = index_with(a=BASE[:3])
    evs = (Stored(tuple(BASE[3:6]), BASE[2], "host"), Stored(tuple(FORK4[4:8]), None, "disk"))
    assert idx.apply(batch("a", 1, *evs)).status == "applied"
    idx.apply_snapshot("a", BASE[:2], 5, tiers={"host": BASE[2:8]})  # no "disk": emptied
    assert idx.snapshot_media()["a"] == {
        "device": sorted(BASE[:2]),
        "host": sorted(BASE[2:8]),
        "disk": [],
    }
    assert idx.tier_depths(BASE) == {"a": {"device": 2, "host": 8, "disk": 8}}
    assert idx.apply(batch("a", 5, Removed((BASE[7],), "host"))).status == "applied"
    idx.apply_snapshot("a", BASE[:2], 6)  # tiers None: both tiers emptied
    assert idx.snapshot_media()["a"] == {"device": sorted(BASE[:2]), "host": [], "disk": []}
    idx.apply_snapshot("a", [], 6, tiers={"host": (), "disk": iter(BASE[:4])})
    assert idx.tier_depths(BASE) == {"a": {"device": 0, "host": 0, "disk": 4}}
    idx.check_integrity()


@pytest.mark.parametrize(
    "tiers",
    [
        {"device": [BASE[0]]},  # the pool's blocks are ``hashes``
        {"host": [BASE[0]], "gpu": []},
        {"disk": [BASE[0][:15]]},
        {"host": ["x" * 16]},
        {"host": b"x" * 16},  # bytes, not an iterable of hashes
        [("host", [BASE[0]])],  # not a mapping
    ],
)
def test_a_bad_tiers_snapshot_changes_nothing(tiers) -> None:
    idx = index_with(a=BASE[:3])
    evs = (Stored(tuple(BASE[3:6]), BASE[2], "host"), Stored(tuple(FORK4[4:8]), None, "disk"))
    assert idx.apply(batch("a", 1, *evs)).status == "applied"
    before = idx.snapshot_media()
    with pytest.raises(ValueError):
        idx.apply_snapshot("a", BASE[:1], 9, tiers=tiers)
    assert idx.snapshot_media() == before
    assert idx.apply(batch("a", 2, Cleared("host"))).status == "applied"  # not 9
    idx.check_integrity()


# -- the index against a naive model of every medium -----------------------------------------

WORKERS = ["w0", "w1", "w2"]
medium = st.sampled_from(MEDIA)
# Two chains sharing 8 blocks and short spans: media interleave along a chain often.
MODEL_CHAINS = [BASE, FORK8]
span = (st.integers(0, len(MODEL_CHAINS) - 1), st.integers(0, 11), st.integers(1, 4))
media_op = st.one_of(
    st.tuples(st.just("store"), medium, *span),
    st.tuples(st.just("remove"), medium, *span),
    st.tuples(st.just("move"), medium, medium, *span),
    st.tuples(st.just("clear"), medium),
    st.tuples(st.sampled_from(["flush", "flush", "drop", "snap", "purge"])),
)


def model_tiers(held: dict[str, dict[str, set[bytes]]], q: list[bytes]) -> dict[str, dict]:
    """tier_depths the slow way: each medium's cumulative depth from scratch."""
    out = {}
    for w, media in held.items():
        depths = []
        for k in range(len(MEDIA)):
            have = set().union(*(media[m] for m in MEDIA[: k + 1]))
            n = 0
            while n < len(q) and q[n] in have:
                n += 1
            depths.append(n)
        if depths[-1] > depths[0]:
            out[w] = dict(zip(MEDIA, depths, strict=True))
    return out


def check_against(idx: Index, held: dict[str, dict[str, set[bytes]]]) -> None:
    idx.check_integrity()
    for q in (*MODEL_CHAINS, BASE[2:], FORK4):
        assert idx.tier_depths(q) == model_tiers(held, q)
        assert idx.lookup(q) == model_lookup({w: m["device"] for w, m in held.items()}, q)
        assert idx.route_lookup(q)["tiers"] == idx.tier_depths(q)


def index_view(idx: Index) -> dict[str, dict[str, set[bytes]]]:
    return {w: {m: set(hs) for m, hs in media.items()} for w, media in idx.snapshot_media().items()}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(WORKERS), media_op), max_size=60),
    st.integers(1, 5),
)
def test_tier_depths_match_a_naive_model(ops, max_blocks) -> None:
    idx = Index(FP)
    truth = {w: {m: set() for m in MEDIA} for w in WORKERS}
    pubs = {w: EventPublisher(w, max_blocks_per_batch=max_blocks) for w in WORKERS}
    lost = dict.fromkeys(WORKERS, False)  # a batch of it was lost since its last snapshot
    for w in WORKERS:
        idx.register(w, FP)

    def snap(w: str) -> None:
        tiers = {m: list(truth[w][m]) for m in MEDIA[1:] if truth[w][m]}  # empty: left out
        idx.apply_snapshot(w, truth[w]["device"], pubs[w].reset_for_snapshot(), tiers=tiers)
        lost[w] = False

    for w, (kind, *args) in ops:
        pub, mine = pubs[w], truth[w]
        if kind in ("store", "remove", "move"):
            *media, c, start, n = args
            seg = MODEL_CHAINS[c][start : start + n]
            parent = MODEL_CHAINS[c][start - 1] if start else None
            if kind != "store":
                pub.on_remove(seg, media[0])
                mine[media[0]].difference_update(seg)
            if kind != "remove":
                pub.on_store(seg, parent, media[-1])
                mine[media[-1]].update(seg)
        elif kind == "clear":
            pub.on_clear(args[0])
            mine[args[0]].clear()
        elif kind == "flush":
            while (data := pub.drain()) is not None:
                assert idx.apply(data).status in ("applied", "gap")
                check_against(idx, index_view(idx))  # after each batch
            if not lost[w]:
                assert index_view(idx)[w] == mine
        elif kind == "drop" and pub.drain() is not None:
            lost[w] = True
        elif kind == "snap":
            snap(w)
            assert index_view(idx)[w] == mine
        elif kind == "purge":
            assert idx.purge(w)
            idx.register(w, FP)
            pubs[w] = EventPublisher(w, max_blocks_per_batch=max_blocks)
            truth[w] = {m: set() for m in MEDIA}
            lost[w] = False
        check_against(idx, index_view(idx))
    # Reconcile as the connector would: one more batch shows a lost last one as a gap.
    for w in WORKERS:
        marker = xxhash.xxh3_128_digest(w.encode())
        pubs[w].on_store([marker], None)
        truth[w]["device"].add(marker)
        while (data := pubs[w].drain()) is not None:
            idx.apply(data)
        if idx.needs_snapshot(w):
            snap(w)
    assert index_view(idx) == truth
    check_against(idx, truth)
