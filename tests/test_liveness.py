"""``liveness``: keep-alives while a replica waits (``beating``), and a silent call counted as
lost. Plain asyncio generators and sleeps stand in for a slow or hung source (the fault under
test). The engine's own keep-alives are in test_stream_interval.py, the hung replica on real
Serve in test_failover.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.cluster.liveness import WorkerSilent, beating, live_deltas, speaking_for
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


def test_the_replica_speaks_for_its_engine_until_the_engines_first_delta() -> None:
    """An engine call queued for one of the actor's stream threads sends nothing, not even a
    keep-alive, until it gets one (0.5 s here, 3x the ingress's bound): the replica beats
    for it meanwhile. Without that the call counts as lost, a healthy but full worker's."""

    async def go(engine: AsyncIterator[StreamDelta]) -> list[StreamDelta]:
        return [d async for d in live_deltas(engine, 0.15)]

    log: list[str] = []
    out = _run(go(speaking_for(_slow([0.5, 0.0], log), 0.05, BEAT)))
    assert [d.token_ids for d in out if not d.is_empty] == [[0], [1]]
    assert sum(d.is_empty for d in out) >= 5 and log == ["done", "closed"]
    with pytest.raises(WorkerSilent):
        _run(go(_slow([0.5, 0.0], [])))

    async def close_while_waiting(log: list[str]) -> None:
        stream = speaking_for(_slow([10.0], log), 0.05, BEAT)
        assert (await anext(stream)).is_empty
        await stream.aclose()

    log = []
    _run(close_while_waiting(log))
    assert log == ["cancelled", "closed"]  # the engine's call ends with it


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
