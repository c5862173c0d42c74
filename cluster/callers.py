"""``Callers``: what a worker replica must know about the ingress replicas that call it, and
Ray does not handle for it.

- A caller that died: Ray does not cancel the actor tasks of a dead caller, so a lost ingress
  replica's requests would run on to their ``max_tokens`` for nobody, holding batch places
  and blocks. ``Callers`` checks each caller of a running request every health-check period
  and cancels the requests of one that is gone, as Serve does when a caller cancels (the
  engine aborts the request and frees its blocks).
- A caller that cannot answer now (its process stopped, its host cut off): Ray ends a
  streaming call by waiting until the caller acknowledged every item it was sent
  (ray-project/ray#44079), and for an async actor it waits on the event loop, holding it. So
  a call that ended while its caller could not answer froze the whole worker replica: its
  other requests, and Serve's health checks on it, which then replaced a healthy worker and
  its KV cache. ``answered`` lets a call end only once its caller answers.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ray.exceptions import RayActorError

logger = logging.getLogger(__name__)
# Longest a caller's liveness check may take; one that does not answer is not known dead.
CALLER_CHECK_TIMEOUT_S = 10.0
# Longest a call waits at its end for its caller to answer. Serve replaces a stopped ingress
# replica well within it (five health-check periods, three times) and Ray declares a lost
# host's actors dead within it; past it the call ends anyway.
ANSWER_WAIT_S = 120.0


class Callers:
    """The tasks running requests on one worker replica, by their caller's actor handle."""

    def __init__(self, worker: str, period_s: float) -> None:
        self.worker = worker
        self.period_s = period_s
        self._tasks: dict[Any, set[asyncio.Task]] = {}
        self._watcher: asyncio.Task | None = None
        # One liveness check in flight per caller, shared by every call ending meanwhile.
        self._checks: dict[Any, asyncio.Future] = {}

    def add(self, caller: Any) -> asyncio.Task | None:
        """Count the current task under ``caller``, and make sure someone checks that the
        caller lives. None when there is no caller to watch."""
        task = asyncio.current_task()
        if caller is None or task is None:
            return None
        self._tasks.setdefault(caller, set()).add(task)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.create_task(self._watch())
        return task

    def discard(self, caller: Any, task: asyncio.Task | None) -> None:
        tasks = self._tasks.get(caller) if task is not None else None
        if tasks is not None:
            tasks.discard(task)
            if not tasks:
                del self._tasks[caller]

    async def answered(self, caller: Any) -> None:
        """Return once ``caller`` answers a liveness check (or is known gone, or
        ``ANSWER_WAIT_S`` passed): then Ray's wait at the call's end is short. Calls ending
        at once share one check. Their caller answers from its core worker's threads, so a
        caller that is busy, its event loop included, answers in a round trip."""
        if caller is None:
            return
        check = self._checks.get(caller)
        if check is None or check.done():  # a check that ended before this call's end: anew
            check = asyncio.ensure_future(self._check(caller))
            self._checks[caller] = check
            check.add_done_callback(lambda done: self._forget(caller, done))
        # Shielded: a call cancelled while it waits must not cancel the others' check.
        await asyncio.shield(check)

    def _forget(self, caller: Any, check: asyncio.Future) -> None:
        if self._checks.get(caller) is check:
            del self._checks[caller]

    async def _check(self, caller: Any) -> None:
        try:
            await asyncio.wait_for(caller.__ray_ready__.remote(), ANSWER_WAIT_S)
        except RayActorError:
            pass  # gone: Ray's acknowledgements fail at once, nothing holds the loop
        except TimeoutError:
            logger.warning(
                "%s: a caller left a call's end unanswered for %.0f s; ending it anyway",
                self.worker,
                ANSWER_WAIT_S,
            )

    async def _watch(self) -> None:
        """Every health-check period, cancel the requests whose caller died."""
        while self._tasks:
            await asyncio.sleep(self.period_s)
            callers = list(self._tasks)
            checks = await asyncio.gather(
                *(
                    asyncio.wait_for(c.__ray_ready__.remote(), CALLER_CHECK_TIMEOUT_S)
                    for c in callers
                ),
                return_exceptions=True,
            )
            for caller, check in zip(callers, checks, strict=True):
                if not isinstance(check, RayActorError):
                    continue  # alive, or busy or unreachable now: not known to be gone
                tasks = self._tasks.pop(caller, set())
                logger.warning(
                    "%s: the caller of %d running requests is gone; aborting them",
                    self.worker,
                    len(tasks),
                )
                for t in tasks:
                    t.cancel()
