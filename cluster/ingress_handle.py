"""The ingress's handle for Python callers, with the front door's replay.

Serve's ``DeploymentHandle`` raises Ray's ``ActorDiedError`` to its caller when the ingress
replica that held a request is lost (its process killed, its node gone), although the
caller has received nothing and another ingress replica could answer it whole. Over HTTP the
front door sends such a request again (``front_door.py``); ``IngressHandle`` does the same
for handle callers, with the door's bounds:

- a request lost before its answer, or a stream lost before its first chunk, is sent again
  after ``RETRY_PAUSE_S``, up to ``RETRIES`` times: Serve's router has dropped the dead
  replica, so a try reaches another ingress replica or waits in Serve's queue for the
  replacement;
- one lost every time raises ``ApiError`` 503 (``LOST``), the HTTP route's answer;
- a stream lost after its first chunk raises the same ``ApiError`` (the HTTP stream's error
  event): the chunks the caller has stand, and sending it again would repeat them.

What the ingress itself raises (Ray hands it over as a ``RayTaskError``, whose message holds
the replica's traceback, pid and actor id) is raised as the ingress raised it: ``ApiError``,
``BadRequest``, Serve's ``BackPressureError``, ``WorkerLostError``, with their own messages.

Ray reports a replica it cannot reach (``ActorUnavailableError``, a partition) like a dead
one; such a request may still be running there, so sending it again may compute it twice,
as the door's retry of Serve's 500 may. Everything else is Serve's handle as it is:
``options`` (``stream=True``), ``.remote`` on a method, ``await`` / ``.result()`` /
``cancel()`` on an answer, ``async for`` / ``for`` over a stream. ``handle`` is Serve's own
(to hand a response to another deployment, which this wrapper cannot).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from kvmesh.cluster.api_error import root_cause
from kvmesh.cluster.front_door import LOST, RETRIES, RETRY_PAUSE_S, unavailable_error

logger = logging.getLogger(__name__)


class IngressHandle:
    """Serve's handle of the ingress (``KvmeshServer``), each call answered as the module
    says. ``deploy(config)`` returns one; ``serve_app.app_handle()`` one for an app started
    otherwise (``kvmesh serve``, a serve config, KubeRay)."""

    def __init__(self, handle: Any, stream: bool = False) -> None:
        self.handle = handle
        self.stream = stream

    def options(self, **kwargs: Any) -> IngressHandle:
        return IngressHandle(self.handle.options(**kwargs), kwargs.get("stream", self.stream))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy, pickle and friends probe these
            raise AttributeError(name)
        if hasattr(type(self.handle), name):  # Serve's own: deployment_name, shutdown, ...
            return getattr(self.handle, name)
        return _Method(self, name)  # any other name is a method of the ingress, as in Serve

    def __reduce__(self) -> tuple[Any, ...]:
        return IngressHandle, (self.handle, self.stream)


class _Method:
    def __init__(self, owner: IngressHandle, name: str) -> None:
        self.owner, self.name = owner, name

    def remote(self, *args: Any, **kwargs: Any) -> Answer | Stream:
        def send() -> Any:
            return getattr(self.owner.handle, self.name).remote(*args, **kwargs)

        return Stream(send) if self.owner.stream else Answer(send)


class _Tries:
    """One request's sends: the current one, and whether a loss may be sent again."""

    def __init__(self, send: Callable[[], Any]) -> None:
        self.send = send
        self.current = send()  # sent at once, as Serve's ``remote`` sends
        self.losses = 0

    def failed(self, error: RayTaskError | RayActorError, started: bool) -> None:
        """After ``error`` from the current send: raises what the ingress raised; for a lost
        ingress returns when the request is to be sent again (after the pause), else raises
        the 503."""
        if isinstance(error, RayTaskError):  # the ingress ran and raised (also a RayActorError
            raise root_cause(error) from error  # of a call it made, which is its own business)
        self.losses += 1
        if started or self.losses > RETRIES:
            if not started:
                logger.warning("a handle request was lost %d times: raising 503", self.losses)
            raise unavailable_error(LOST) from error
        logger.info("the ingress replica holding a handle request was lost; sending it again")

    def again(self) -> None:
        self.current = self.send()


class Answer:
    """The answer to one non-streaming call: ``await`` it, or ``result()`` outside an event
    loop."""

    def __init__(self, send: Callable[[], Any]) -> None:
        self._tries = _Tries(send)

    def result(self, timeout_s: float | None = None) -> Any:
        """The answer; ``timeout_s`` bounds all the tries together (Serve's TimeoutError)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return self._tries.current.result(timeout_s=left)
            except (RayTaskError, RayActorError) as e:
                self._tries.failed(e, started=False)
            time.sleep(RETRY_PAUSE_S)
            self._tries.again()

    async def _answer(self) -> Any:
        while True:
            try:
                return await self._tries.current
            except (RayTaskError, RayActorError) as e:
                self._tries.failed(e, started=False)
            await asyncio.sleep(RETRY_PAUSE_S)
            self._tries.again()

    def __await__(self) -> Any:
        return self._answer().__await__()

    def cancel(self) -> None:
        self._tries.current.cancel()


class Stream:
    """The chunks of one streaming call: ``async for`` them, or ``for`` outside an event
    loop."""

    def __init__(self, send: Callable[[], Any]) -> None:
        self._tries = _Tries(send)
        self._started = False

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                chunk = next(self._tries.current)
            except (RayTaskError, RayActorError) as e:
                self._tries.failed(e, self._started)
            else:
                self._started = True
                return chunk
            time.sleep(RETRY_PAUSE_S)
            self._tries.again()

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        while True:
            try:
                chunk = await self._tries.current.__anext__()
            except (RayTaskError, RayActorError) as e:
                self._tries.failed(e, self._started)
            else:
                self._started = True
                return chunk
            await asyncio.sleep(RETRY_PAUSE_S)
            self._tries.again()

    def cancel(self) -> None:
        self._tries.current.cancel()
