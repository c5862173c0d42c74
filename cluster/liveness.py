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
thread is no sign. The keep-alive comes from the engine's streams (coroutines), apart from the
step thread, and passes through the replica, so its silence says a process on the way does not
answer: the engine's or the replica's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import ray

from kvmesh.connector.expiring import Expiring
from kvmesh.workers.outputs import StreamDelta

logger = logging.getLogger(__name__)

# Health-check periods a worker call may stay silent before it counts as lost: the keep-alive
# comes every period, so this leaves room for a busy event loop or a slow link.
SILENT_PERIODS = 5
# How long an ingress avoids a worker it lost a call on. Serve lists a hung replica for
# about 90 s (three failed health checks, then a graceful stop it cannot answer), and each
# request routed there meanwhile would wait out a silence of its own. Renewed at each loss;
# a worker that only paused is used again as soon as it answers a probe (``LostWorkers``).
AVOID_S = 30.0
ENGINE_NAMESPACE = "kvmesh"  # where engine actors are named (``engine_actor_name``)


def engine_actor_name(worker: str) -> str:
    """The name of worker ``worker``'s engine actor: an ingress that lost a call there asks
    it whether the worker answers again (``LostWorkers``)."""
    return f"kvmesh-engine-{worker}"


class WorkerSilent(Exception):
    """A worker call sent nothing, not even a keep-alive, for ``SILENT_PERIODS`` periods."""


class LostWorkers:
    """The workers an ingress lost calls on lately (dead or silent), which every request it
    sends avoids (``lost_on``): each until it answers a probe, or for ``AVOID_S`` after its
    latest loss if it never does (a hung replica that Serve still lists)."""

    def __init__(self, period_s: float, stall_s: float, avoid_s: float = AVOID_S) -> None:
        self.period_s = period_s
        self.stall_s = stall_s
        self._lost = Expiring(avoid_s)
        self._probes: dict[str, asyncio.Task] = {}  # worker -> its probe, while avoided

    def add(self, worker: str) -> None:
        """``worker`` lost a call (from the ingress's event loop)."""
        self._lost.add(worker)
        if worker not in self._probes:
            task = asyncio.get_running_loop().create_task(self._probe(worker))
            self._probes[worker] = task
            task.add_done_callback(lambda _: self._probes.pop(worker, None))

    def members(self) -> tuple[str, ...]:
        return self._lost.members()

    async def _probe(self, worker: str) -> None:
        """Each period while ``worker`` is avoided, ask its engine actor whether it would
        serve (``WorkerActor.answers``: its step thread is fine and its replica checks on
        it); the first yes ends the avoidance. So a worker that paused, or whose link was cut
        and came back, serves again a period or two after it answers, not ``AVOID_S`` after
        it was lost; a hung replica or engine stays avoided."""
        engine: Any = None
        while worker in self._lost:
            await asyncio.sleep(self.period_s)
            try:
                engine = engine or await asyncio.to_thread(
                    ray.get_actor, engine_actor_name(worker), ENGINE_NAMESPACE
                )
                answers = engine.answers.remote(self.stall_s, 3 * self.period_s)
                if await asyncio.wait_for(answers, self.period_s):
                    self._lost.discard(worker)
                    logger.info("worker %s answers again; routing requests to it", worker)
            except ValueError:  # no such actor: the worker is gone (its replacement has a
                return  # name of its own)
            except Exception:  # no answer in time, or none yet: ask again
                continue


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
