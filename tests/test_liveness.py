"""``liveness``: keep-alives while a replica waits (``beating``), a silent call counted as
lost, and the workers lost lately (``Expiring``). Plain asyncio generators and sleeps stand
in for a slow or hung source (the fault under test). The engine's own keep-alives are in
test_stream_interval.py, the hung replica on real Serve in test_failover.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from kvmesh.cluster.liveness import WorkerSilent, beating, live_deltas
from kvmesh.connector.expiring import Expiring
from kvmesh.workers.outputs import StreamDelta

BEAT = StreamDelta("r", worker="w")


async def _slow(gaps: list[float], log: list[str]) -> AsyncIterator[StreamDelta]:
    """A delta with one token after each gap; ``log`` records how it ended."""
    try:
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            yield StreamDelta("r", [i], str(i))
        log.append("done")
    except asyncio.CancelledError:
        log.append("cancelled")
        raise
    finally:
        log.append("closed")


def _run(coro):
    return asyncio.run(coro)


def test_a_replicas_own_wait_sends_keep_alives() -> None:
    async def go() -> list[StreamDelta]:
        return [d async for d in beating(asyncio.sleep(0.35), 0.1, BEAT)]

    assert 2 <= len(_run(go())) <= 4  # one per 0.1 s of the 0.35 s wait


def test_keep_alives_keep_a_slow_call_alive() -> None:
    """Silent for 0.5 s, 3x the ingress's bound: the keep-alives carry it."""

    async def wait_then_send() -> AsyncIterator[StreamDelta]:
        async for b in beating(asyncio.sleep(0.5), 0.05, BEAT):
            yield b
        yield StreamDelta("r", [1], "1")

    async def go() -> list[StreamDelta]:
        return [d async for d in live_deltas(wait_then_send(), 0.15)]

    out = _run(go())
    assert [d.token_ids for d in out if not d.is_empty] == [[1]]
    assert sum(d.is_empty for d in out) >= 5


def test_a_silent_call_is_lost() -> None:
    async def go() -> list[StreamDelta]:
        return [d async for d in live_deltas(_slow([0.0, 10.0], log), 0.15)]

    log: list[str] = []
    with pytest.raises(WorkerSilent):
        _run(go())
    assert log == ["cancelled", "closed"]  # its read was cancelled (the caller cancels the call)


def test_closing_or_cancelling_a_wait_ends_it() -> None:
    """However the call ends while the replica waits, the wait is cancelled."""

    async def wait(log: list[str]) -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            log.append("cancelled")
            raise

    async def close_at_a_beat(log: list[str]) -> None:
        stream = beating(wait(log), 0.05, BEAT)
        assert (await anext(stream)).is_empty
        await stream.aclose()

    async def cancel_while_waiting(log: list[str]) -> None:
        async def read() -> None:
            async for _ in beating(wait(log), 0.05, BEAT):
                pass

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.2)  # a few keep-alives went by
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    for case in (close_at_a_beat, cancel_while_waiting):
        log: list[str] = []
        _run(case(log))
        assert log == ["cancelled"], case.__name__


def test_lost_workers_are_avoided_for_a_while_and_then_not() -> None:
    lost = Expiring(0.2)
    assert lost.members() == ()
    lost.add("worker-a")
    lost.add("worker-b")
    assert lost.members() == ("worker-a", "worker-b")
    time.sleep(0.1)
    lost.add("worker-b")  # lost again: avoided for longer
    time.sleep(0.15)
    assert lost.members() == ("worker-b",)
    assert "worker-b" in lost and "worker-a" not in lost
    time.sleep(0.1)
    assert lost.members() == ()
    assert "worker-b" not in lost
    lost.add("worker-a")
    lost.add("worker-b")
    lost.discard("worker-a")  # it answers again
    assert lost.members() == ("worker-b",)
