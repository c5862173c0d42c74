"""Media in the event schema and the publisher: the wire layout with media, whole-batch
rejection of a bad medium, the publisher's per-medium coalescing and ``on_clear(medium)``."""

from __future__ import annotations

import msgpack
import pytest

from kvmesh.connector.events import (
    MEDIA,
    MEDIUM_DEVICE,
    MEDIUM_DISK,
    MEDIUM_HOST,
    MEDIUM_IDS,
    SCHEMA_VERSION,
    Cleared,
    EventBatch,
    EventPublisher,
    MalformedBatch,
    Removed,
    Stored,
    decode_batch,
    decode_records,
    encode_batch,
)
from tests.kv_index_helpers import BASE, FORK4, batch, index_with, pack


def drained(pub: EventPublisher) -> list[EventBatch]:
    out = []
    while (data := pub.drain()) is not None:
        out.append(decode_batch(data))
    return out


# -- the schema ------------------------------------------------------------------------------


def test_media_constants() -> None:
    assert SCHEMA_VERSION == 2
    assert MEDIA == ("device", "host", "disk")
    assert (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_DISK) == (0, 1, 2)
    assert all(MEDIA[MEDIUM_IDS[m]] == m for m in MEDIA)


def test_wire_round_trip_with_media() -> None:
    b = EventBatch(
        "a",
        7,
        (
            Stored(tuple(BASE[:2])),  # device by default
            Stored(tuple(BASE[2:4]), BASE[1], "host"),
            Removed((BASE[0],), "disk"),
            Cleared("host"),
            Cleared(),
        ),
    )
    data = encode_batch(b)
    assert decode_batch(data) == b
    assert msgpack.unpackb(data) == [
        SCHEMA_VERSION,
        "a",
        7,
        [
            [1, BASE[:2], None, 0],
            [1, BASE[2:4], BASE[1], 1],
            [2, [BASE[0]], 2],
            [3, 1],
            [3, 0],
        ],
    ]
    _, _, records = decode_records(data)
    assert [r[3] for r in records] == ["device", "host", "disk", "host", "device"]
    assert Cleared() == Cleared("device") and Stored((BASE[0],)).medium == "device"


def test_events_refuse_an_unknown_medium() -> None:
    for make in (
        lambda: Stored((BASE[0],), None, "gpu"),
        lambda: Removed((BASE[0],), "Device"),
        lambda: Cleared(1),  # the wire int is not a medium name
    ):
        with pytest.raises(ValueError, match="medium"):
            make()


GOOD = [1, [BASE[0]], None, MEDIUM_HOST]
BAD_MEDIUM = {
    "medium 3": [[1, [BASE[1]], None, 3]],
    "medium -1": [[2, [BASE[1]], -1]],
    "medium as name": [[3, "host"]],
    "medium as bool": [[3, True]],
    "medium nil": [[2, [BASE[1]], None]],
    "medium float": [[1, [BASE[1]], None, 1.0]],
}
MALFORMED = {
    **{name: pack(SCHEMA_VERSION, "a", 1, [GOOD, *events]) for name, events in BAD_MEDIUM.items()},
    "v1 stored (no medium)": pack(SCHEMA_VERSION, "a", 1, [GOOD, [1, [BASE[1]], None]]),
    "v1 cleared (no medium)": pack(SCHEMA_VERSION, "a", 1, [GOOD, [3]]),
    "v1 removed (no medium)": pack(SCHEMA_VERSION, "a", 1, [GOOD, [2, [BASE[1]]]]),
    "v1 batch": pack(1, "a", 1, [[1, [BASE[0]], None]]),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_bad_medium_rejects_the_batch_whole(name: str) -> None:
    idx = index_with(a=BASE[:2], b=FORK4[:5])
    before = idx.snapshot_media()
    with pytest.raises(MalformedBatch) as info:
        decode_batch(MALFORMED[name])
    if name in BAD_MEDIUM:
        assert "event 1" in str(info.value) and "medium" in str(info.value)
    result = idx.apply(MALFORMED[name])
    assert result.status == "rejected" and result.reason
    # The good first event (host) was not applied either.
    assert idx.snapshot_media() == before and idx.stats()["batches_rejected"] == 1
    assert idx.stats()["host_entries"] == 0
    assert idx.apply(batch("a", 1, Stored((BASE[2],), BASE[1], "host"))).status == "applied"
    idx.check_integrity()


# -- the publisher ---------------------------------------------------------------------------


def test_publisher_coalesces_per_medium_only() -> None:
    pub = EventPublisher("a")
    pub.on_store(BASE[:3], None)  # an existing caller: device
    pub.on_store(BASE[3:5], BASE[2], "host")  # continues the chain, in another medium: apart
    pub.on_store(BASE[5:6], BASE[4], "host")  # continues the host chain: merged
    pub.on_remove([FORK4[5]], "host")
    pub.on_remove([FORK4[6]], "host")  # merged
    pub.on_remove([FORK4[7]], "disk")  # another medium: apart
    pub.on_remove([FORK4[8]])  # device: apart
    assert pub.pending_blocks == 3 + 3 + 2 + 1 + 1
    (got,) = drained(pub)
    assert got.events == (
        Stored(tuple(BASE[:3]), None, "device"),
        Stored(tuple(BASE[3:6]), BASE[2], "host"),
        Removed(tuple(FORK4[5:7]), "host"),
        Removed((FORK4[7],), "disk"),
        Removed((FORK4[8],), "device"),
    )
    # A device -> host move of each block: every record kept, in order.
    for h in BASE[:2]:
        pub.on_remove([h])
        pub.on_store([h], None, "host")
    assert [(type(e).__name__, e.medium) for e in drained(pub)[0].events] == [
        ("Removed", "device"),
        ("Stored", "host"),
    ] * 2
    with pytest.raises(ValueError, match="medium"):
        pub.on_store([BASE[0]], None, "gpu")
    with pytest.raises(ValueError, match="medium"):
        pub.on_remove([BASE[0]], "gpu")
    with pytest.raises(ValueError, match="medium"):
        pub.on_clear("gpu")
    assert pub.drain() is None  # nothing was buffered by the refused calls


def test_on_clear_drops_only_its_medium() -> None:
    pub = EventPublisher("a")
    pub.on_store(BASE[:2], None)
    pub.on_remove([FORK4[5]], "host")
    pub.on_store(BASE[4:6], None, "disk")
    pub.on_store(FORK4[:2], None)  # device again
    pub.on_clear()  # device: its two stores are moot
    pub.on_clear("host")  # host: its remove is moot
    (got,) = drained(pub)
    assert got.events == (Stored(tuple(BASE[4:6]), None, "disk"), Cleared(), Cleared("host"))
    pub.on_clear("disk")
    pub.on_clear("disk")  # the first one is moot too
    assert drained(pub)[0].events == (Cleared("disk"),)


def test_drain_splits_keep_media_and_the_budget() -> None:
    pub = EventPublisher("a", max_blocks_per_batch=3)
    pub.on_store(BASE[:5], None, "host")
    pub.on_remove(FORK4[4:8], "disk")
    pub.on_clear("device")
    got = drained(pub)
    assert all(sum(max(1, len(getattr(e, "hashes", ()))) for e in b.events) <= 3 for b in got)
    assert [b.seq for b in got] == [0, 1, 2, 3]
    assert got[0].events == (Stored(tuple(BASE[:3]), None, "host"),)
    assert got[1].events == (
        Stored(tuple(BASE[3:5]), BASE[2], "host"),  # the rest of the chain, still host
        Removed((FORK4[4],), "disk"),
    )
    assert got[2].events == (Removed(tuple(FORK4[5:8]), "disk"),)
    assert got[3].events == (Cleared("device"),)
