"""Pending entries in KvIndex, prompts being computed now as shared routing state: a raced
entry refused, depths, wait tokens and backlog, expiry, and ends on a store or a purge."""

from __future__ import annotations

import pytest

from kvmesh.connector.events import Stored
from kvmesh.connector.pending_entries import (
    MAX_PENDING_TTL_S,
    RACE_WINDOW_S,
    UNCONFIRMED_TTL_S,
    PendingEntries,
)
from tests.kv_index_helpers import BASE, FORK4, FORK8, FP, Index, batch, chain, index_with


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
        "nodes": {"a": None, "b": None},  # the registered ones (without a node)
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
    token = idx.register("a", FP)
    short = idx.add_pending("a", BASE[:4], 10, ttl_s=5)
    confirmed = idx.add_pending("a", FORK4[:6], 20, ttl_s=30)
    assert idx.confirm_pending("a", confirmed, FORK4, token)  # its worker got the request
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


def test_an_entry_its_worker_never_confirms_is_believed_briefly() -> None:
    """Anyone may add an entry; only the worker, with its token and the hashes of the prompt
    it was sent, makes it live its time to live. A forged one goes after UNCONFIRMED_TTL_S."""
    clock = FakeClock()
    idx = Index(FP, clock=clock)
    token_a, token_b = idx.register("a", FP), idx.register("b", FP)
    forged = idx.add_pending("a", BASE[:8], 64, ttl_s=MAX_PENDING_TTL_S)
    real = idx.add_pending("a", FORK4[:6], 20, ttl_s=60)
    assert idx.next_pending_expiry() == 1000.0 + UNCONFIRMED_TTL_S
    with pytest.raises(PermissionError):
        idx.confirm_pending("a", forged, BASE, token_b)  # another worker's token
    assert idx.stats()["unauthorized"] == 1
    assert not idx.confirm_pending("b", forged, BASE, token_b)  # not b's entry
    assert not idx.confirm_pending("a", forged, FORK4, token_a)  # not the prompt a was sent
    assert not idx.confirm_pending("a", forged, BASE[:7], token_a)  # a shorter prompt
    clock.now += 5
    assert idx.confirm_pending("a", real, FORK4, token_a)
    assert idx.confirm_pending("a", real, FORK4, token_a)  # again: no change
    clock.now = 1000.0 + UNCONFIRMED_TTL_S
    assert idx.route_lookup(BASE)["pending"] == {"a": {"depth": 4, "wait_tokens": 20}}
    assert idx.pending_depth("a", BASE[:8]) == 4  # only the confirmed entry's shared blocks
    assert idx.next_pending_expiry() == 1065.0
    clock.now = 1064.9
    assert idx.expire_pending() == 0
    clock.now = 1065.0
    assert idx.expire_pending() == 1 and not idx.confirm_pending("a", real, FORK4, token_a)
    stats = idx.stats()
    assert (stats["pending_confirmed"], stats["pending_expired"]) == (1, 2)
    idx.check_integrity()


def test_eviction_past_the_budget_skips_a_confirmed_entrys_old_expiry() -> None:
    clock = FakeClock()
    pending = PendingEntries(clock, max_entries=2)
    first = pending.add("a", BASE[:2], 10, ttl_s=60)
    assert pending.confirm(first, "a", BASE)  # now expires at 1060, after the next one
    clock.now += 1
    second = pending.add("a", FORK4[:2], 10, ttl_s=60)  # unconfirmed: expires at 1011
    pending.add("a", FORK8[:2], 10, ttl_s=60)  # over budget: the one expiring first goes
    assert set(pending.entries()) == {first, second + 1}
    pending.check_integrity()


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


@pytest.mark.parametrize("ttl_s", [MAX_PENDING_TTL_S * 2, float("inf"), 1e9, 0, -1])
def test_a_pending_entry_lives_at_most_the_cap(ttl_s: float) -> None:
    """Any Ray caller can add pending entries: one that would outlive MAX_PENDING_TTL_S (and
    make routers send a prompt's followers to wait on a worker that never computes it) is
    refused."""
    idx = index_with(a=BASE[:1])
    with pytest.raises(ValueError, match="ttl_s"):
        idx.add_pending("a", BASE, 10, ttl_s=ttl_s)
    assert idx.add_pending("a", BASE, 10, ttl_s=MAX_PENDING_TTL_S) is not None


def test_a_flood_of_pending_entries_stays_within_its_budget() -> None:
    """Past ``max_entries`` live entries, or ``max_hashes`` hashes in them, a new entry drops
    the ones that expire first (counted), so a caller flooding the index costs routing hints,
    never unbounded memory or lookups."""
    clock = FakeClock()
    pending = PendingEntries(clock, max_entries=3, max_hashes=12)
    ids = []
    for i in range(5):
        clock.now += 1
        ids.append(pending.add(f"w{i}", FORK4[:2], 10, ttl_s=60))
        pending.check_integrity()
    assert len(pending) == 3 and pending.counts["pending_evicted"] == 2
    assert pending.depth("w0", FORK4) == 0 and pending.depth("w4", FORK4) == 2
    # 3 entries of 2 hashes + one of 8 is over 12 hashes: the oldest goes (4 + 8 fit).
    pending.add("big", BASE[:8], 10, ttl_s=60)
    pending.check_integrity()
    assert len(pending) == 3 and pending.counts["pending_evicted"] == 3
    assert pending.depth("w2", FORK4) == 0 and pending.depth("w3", FORK4) == 2
    assert pending.depth("big", BASE) == 8
    with pytest.raises(ValueError, match="at most 12 hashes"):
        pending.add("huge", chain(b"huge", 13), 10)
    pending.check_integrity()
