"""Asynchronous KV loads: the step loop never waits on a load, and a load never yields wrong KV.

An engine (and a threaded worker) whose connector is the in-memory store behind a gate the test
opens (a slow link, on purpose), so the other request's steps while a load is in flight are
counted exactly; failed loads, aborts during a load, and a transfer that cannot be stopped (its
blocks quarantined), all against the no-connector reference. tests/test_pull_plan.py has the
same on real Ray workers with NIXL, and the router's plans.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.outputs import RequestOutput
from kvmesh.workers.request import RequestStatus
from kvmesh.workers.worker import Worker
from tests.async_load_helpers import (
    BS,
    GREEDY,
    LONG,
    NUM_BLOCKS,
    OTHER,
    PEER,
    PREFIX,
    GatedConnector,
    config,
    gated,
    key,
    primed,
    reference_tokens,
)
from tests.cluster_helpers import wait_until


@pytest.fixture(scope="module")
def reference() -> dict[tuple[int, ...], list[int]]:
    return reference_tokens()


def test_a_slow_load_does_not_stop_other_decodes(reference: dict) -> None:
    eng, conn, d = primed()
    other = eng.add_request(OTHER, LONG)
    for _ in range(3):
        d.step()
    pulled = eng.add_request(PREFIX, GREEDY)
    before = d.tokens[other]
    for _ in range(20):  # the load is in flight all along: its gate is closed
        d.step()
    assert len(conn.block_ids) == 1 and list(eng.scheduler.loading) == [pulled]
    assert eng.scheduler.loading[pulled].status is RequestStatus.WAITING_FOR_REMOTE_KV
    assert d.tokens[other] - before == 20  # one token per step, none missed
    assert pulled not in d.tokens
    eng.kv.check_integrity()
    conn.gate.set()
    out = d.finish([pulled, other])
    assert out[pulled].metrics.num_pulled_tokens == 40
    assert out[pulled].metrics.num_computed_tokens == 1
    assert out[pulled].token_ids == reference[key(PREFIX, GREEDY)]
    assert out[other].token_ids == reference[key(OTHER, LONG)]
    eng.kv.check_integrity()


def test_only_the_request_that_read_reports_the_reads(reference: dict) -> None:
    """Two requests for one prefix: the first loads it, the second waits for that load and
    hits its blocks. Only the first read anything (the router learns a pull's cost from it;
    the second, charged the first's read, taught a pull ten times its cost)."""
    eng, conn, d = primed()
    first = eng.add_request(PREFIX, GREEDY)
    d.step()
    second = eng.add_request(PREFIX, GREEDY)
    for _ in range(5):
        d.step()
    time.sleep(0.05)
    conn.gate.set()
    out = d.finish([first, second])
    assert len(conn.block_ids) == 1  # one load
    m1, m2 = out[first].metrics, out[second].metrics
    assert m1.num_pulled_tokens == 40 and m1.num_read_blocks == 10
    assert m1.read_s >= 0.05 and m1.read_from == PEER  # the link whose cost it measured
    assert m2.num_pulled_tokens == 0 and m2.num_local_hit_tokens == 40
    assert m2.num_read_blocks == 0 and m2.read_s == 0.0 and m2.read_from is None
    assert out[second].token_ids == reference[key(PREFIX, GREEDY)]


def test_a_failed_load_computes_the_tokens(reference: dict) -> None:
    eng, conn, d = primed()
    conn.mode = "fail"  # the load scribbles over its blocks, then fails
    rid = eng.add_request(PREFIX, GREEDY)
    d.step()
    assert list(eng.scheduler.loading) == [rid]
    conn.gate.set()
    out = d.finish([rid])[rid]
    assert out.metrics.num_pulled_tokens == 0
    assert out.metrics.num_read_blocks == 10  # the failed read is a cost to learn too
    assert out.metrics.num_computed_tokens == len(PREFIX)
    assert out.token_ids == reference[key(PREFIX, GREEDY)]
    eng.kv.check_integrity()


def test_abort_during_a_load_frees_its_blocks_only_when_it_ends(reference: dict) -> None:
    eng, conn, d = primed()
    rid = eng.add_request(PREFIX, GREEDY)
    d.step()
    (load_blocks,) = conn.block_ids.values()
    eng.abort(rid)
    assert rid not in eng.request_ids() and not eng.scheduler.loading
    blocks = [eng.kv.pool.blocks[b] for b in load_blocks]

    def held_by_the_load() -> bool:
        return all(b.ref_cnt == 1 and b not in eng.kv.pool.free_queue for b in blocks)

    assert held_by_the_load()
    eng.kv.check_integrity()  # the load's blocks are accounted for
    # Another request runs meanwhile and never gets a block the load may still write.
    other = eng.add_request(OTHER, GREEDY)
    d.until(lambda: other in d.outputs or not held_by_the_load())
    assert held_by_the_load()
    assert d.outputs[other].token_ids == reference[key(OTHER, GREEDY)]
    conn.gate.set()
    d.until(lambda: not eng.kv.awaits_connector)
    assert all(b.ref_cnt == 0 and b in eng.kv.pool.free_queue for b in blocks)
    # What the load filled is kept as cache: the next request for the prefix hits it.
    chain = block_hashes(PREFIX, BS, eng.fingerprint.namespace)[:10]
    assert all(eng.kv.pool.get_cached_block(h) is not None for h in chain)
    eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == NUM_BLOCKS


def test_a_transfer_that_cannot_stop_quarantines_its_blocks(reference: dict) -> None:
    eng, conn, d = primed()
    conn.mode = "writing"
    rid = eng.add_request(PREFIX, GREEDY)
    d.step()
    (load_blocks,) = conn.block_ids.values()
    conn.gate.set()
    d.until(lambda: d.tokens.get(rid, 0) >= 2)  # started over, computing, decoding
    assert eng.kv.quarantine and all(eng.kv.pool.blocks[b].ref_cnt == 1 for b in load_blocks)
    assert not set(load_blocks) & set(eng.kv.get_block_ids(eng.scheduler.running[0]))
    eng.kv.check_integrity()
    conn.transfer_over.set()  # its late bytes land in the quarantined blocks, not the request's
    out = d.finish([rid])[rid]
    assert out.token_ids == reference[key(PREFIX, GREEDY)]
    assert out.metrics.num_pulled_tokens == 0
    d.until(lambda: not eng.kv.awaits_connector)
    assert not eng.kv.quarantine and eng.kv.num_free_blocks == NUM_BLOCKS
    eng.kv.check_integrity()


# -- the worker's step thread -----------------------------------------------------------------


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker("w-async", config(), gated)
    yield w
    w.shutdown()


def test_worker_keeps_streaming_while_a_load_waits(worker: Worker, reference: dict) -> None:
    worker.generate(PREFIX, GREEDY)
    assert worker.call(worker.kv.reset_prefix_cache)
    conn = worker.kv.connector
    assert isinstance(conn, GatedConnector)
    times: list[float] = []

    def stream_other() -> None:
        for _ in worker.stream(OTHER, LONG):
            times.append(time.monotonic())

    # Daemon threads, and the gate opened whatever happens: a failed check must not leave the
    # test process waiting for them at exit.
    streamer = threading.Thread(target=stream_other, daemon=True)
    streamer.start()
    result: list[RequestOutput] = []
    puller = threading.Thread(
        target=lambda: result.append(worker.generate(PREFIX, GREEDY)), daemon=True
    )
    try:
        assert wait_until(lambda: len(times) >= 3, 30, 0.005)
        puller.start()
        assert wait_until(lambda: worker.occupancy()["loading"] == 1, 30, 0.005)
        start = time.monotonic()
        time.sleep(0.5)
        during = [t for t in times if t > start]
        assert worker.occupancy()["loading"] == 1  # the load was in flight the whole time
        assert len(during) >= 5, f"{len(during)} tokens in 0.5 s while the load waited"
    finally:
        conn.gate.set()
    puller.join(30)
    streamer.join(30)
    assert result[0].token_ids == reference[key(PREFIX, GREEDY)]
    assert result[0].metrics.num_pulled_tokens == 40
    worker.call(worker.kv.check_integrity)


def test_integrity_holds_while_a_peer_holds_a_lease(worker: Worker) -> None:
    worker.generate(PREFIX, GREEDY)
    chain = block_hashes(PREFIX, BS, worker.engine.fingerprint.namespace)[:6]
    lease = worker.pin(chain, 5.0)
    assert lease is not None
    try:
        worker.call(worker.kv.check_integrity)  # failed before: leases were not counted
        assert worker.num_pinned() == 6
    finally:
        worker.release(lease[0])
    worker.call(worker.kv.check_integrity)
    assert worker.num_pinned() == 0
