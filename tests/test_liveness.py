"""``liveness``: keep-alives while a worker has nothing to send, and a silent call counted as
lost. Plain asyncio generators stand in for the worker's deltas (a slow or hung source is
the fault under test); the hung replica on real Serve is in test_failover.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvmesh.cluster.liveness import WorkerSilent, keep_alive, live_deltas
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


def test_a_long_wait_sends_keep_alives_and_loses_nothing() -> None:
    async def go() -> list[StreamDelta]:
        return [d async for d in keep_alive(_slow([0.0, 0.35, 0.0], []), 0.1, BEAT)]

    out = _run(go())
    assert [d.token_ids for d in out if not d.is_empty] == [[0], [1], [2]]
    assert 2 <= sum(d.is_empty for d in out) <= 4  # one per 0.1 s of the 0.35 s wait


def test_keep_alives_keep_a_slow_call_alive_and_name_its_worker() -> None:
    """Silent for 0.5 s, 3x the ingress's bound: the keep-alives carry it, each naming the
    worker (a request still queued there learns from them where it is)."""

    async def go() -> list[StreamDelta]:
        worker = keep_alive(_slow([0.5, 0.0], []), 0.05, BEAT)
        return [d async for d in live_deltas(worker, 0.15)]

    out = _run(go())
    assert [d.token_ids for d in out if not d.is_empty] == [[0], [1]]
    beats = [d for d in out if d.is_empty]
    assert len(beats) >= 5 and {d.worker for d in beats} == {"w"}


def test_a_silent_call_is_lost() -> None:
    async def go() -> list[StreamDelta]:
        return [d async for d in live_deltas(_slow([0.0, 10.0], log), 0.15)]

    log: list[str] = []
    with pytest.raises(WorkerSilent):
        _run(go())
    assert log == ["cancelled", "closed"]  # its read was cancelled (the caller cancels the call)


def test_closing_or_cancelling_ends_the_request() -> None:
    """The request's own cleanup (cancel the engine's call) must run however it ends."""

    async def close_after_first(log: list[str]) -> None:
        stream = keep_alive(_slow([0.0, 10.0], log), 0.05, BEAT)
        assert (await anext(stream)).token_ids == [0]
        await stream.aclose()

    async def cancel_while_waiting(log: list[str]) -> None:
        stream = keep_alive(_slow([10.0], log), 0.05, BEAT)

        async def read() -> None:
            async for _ in stream:
                pass

        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.2)  # a few keep-alives went by
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await stream.aclose()

    # Closed at its yield, the source is closed there; cancelled while waiting, its read is.
    for case, ended in (
        (close_after_first, ["closed"]),
        (cancel_while_waiting, ["cancelled", "closed"]),
    ):
        log: list[str] = []
        _run(case(log))
        assert log == ended, case.__name__
