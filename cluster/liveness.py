"""Whether a worker call is alive. The worker sends an empty delta (a keep-alive) each
health-check period in which it has nothing else to send for a request: its engine actor's
stream does (``Worker.stream(keepalive_s=...)``), and so does the replica while it waits
before calling the engine (for a peer's prefix: ``beating``). The ingress counts a call that
sent nothing, not even that, for
``SILENT_PERIODS`` periods as lost (``live_deltas``), as it counts a dead replica: it cancels
the call and moves the request to another worker, not back to one it was lost on while
another is listed (``WorkerRequest.lost_on``; a keep-alive names its worker).

Without it, a request on a replica whose process hangs (stopped, swapped out, its node cut
off) waits for Serve to give up on the replica: three failed health checks and then a
graceful stop of up to ``drain_timeout_s`` that the hung process cannot answer (about 90 s
measured with the defaults), while its client sees nothing. A request may wait a long time
for its first token (queued, waiting for a peer's prefix, a long prefill), so a silent step
thread is no sign. The keep-alive comes from the engine's stream threads, apart from the step
thread, and passes through the replica, so its silence says a process on the way does not
answer: the engine's or the replica's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

from kvmesh.workers.outputs import StreamDelta

# Health-check periods a worker call may stay silent before it counts as lost: the keep-alive
# comes every period, so this leaves room for a busy event loop or a slow link.
SILENT_PERIODS = 5
# How long an ingress avoids a worker it lost a call on. Serve lists a hung replica for
# about 90 s (three failed health checks, then a graceful stop it cannot answer), and each
# request routed there meanwhile would wait out a silence of its own. Renewed at each loss;
# a worker that only paused is used again after it.
AVOID_S = 30.0


class WorkerSilent(Exception):
    """A worker call sent nothing, not even a keep-alive, for ``SILENT_PERIODS`` periods."""


async def beating(
    waiting: Awaitable[Any], period_s: float, beat: StreamDelta
) -> AsyncIterator[StreamDelta]:
    """Await ``waiting`` (a replica's own wait before it calls its engine: for a peer's
    prefix), yielding ``beat`` (an empty delta) after each ``period_s`` it takes. Closing or
    cancelling it cancels ``waiting``."""
    task = asyncio.ensure_future(waiting)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=period_s)
            if done:
                task.result()
                return
            yield beat
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


async def live_deltas(stream: Any, silent_s: float) -> AsyncIterator[StreamDelta]:
    """A worker call's deltas, keep-alives included (``is_empty``: they say which worker
    holds the call, which a request still queued there knows no other way); ``WorkerSilent``
    when nothing came for ``silent_s`` (the caller then cancels the call: a cancelled read
    does not)."""
    while True:
        try:
            # A deadline on this task, not ``wait_for``'s task per delta: every token's
            # delta passes here.
            async with asyncio.timeout(silent_s):
                delta: StreamDelta = await anext(stream)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise WorkerSilent(f"the worker sent nothing for {silent_s:.0f} s") from None
        yield delta
