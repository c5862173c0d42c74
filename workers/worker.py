"""One engine driven by a step thread, with pins for peers: the body of a worker actor.

Thread model (written down because three kinds of threads meet here):

- The step thread owns the engine: scheduler, block pool, KV cache manager, model. Nothing
  else touches them. It loops: run queued commands, serve peers' pins and releases, release
  expired leases, ``engine.step()``. It never waits on the network: the connector looks up
  and loads on threads of its own, and wakes the step thread (``attach``) when an answer or
  a load's result is ready. When every request waits on the connector it sleeps until then.
- Callers (the Ray actor's coroutines, or a test's thread) never touch the engine: they
  enqueue a command and wait on its future (``call``, or ``acall`` without a thread), or
  await a request's deltas (``astream``: the step thread hands each to the stream's event
  loop).
- Peer commands (``pin`` / ``release``) go on a separate queue, served every iteration, so a
  peer's pull waits at most one step for its pin (and two workers pulling from each other
  cannot deadlock: neither step thread waits for the other). Pins go through the KV cache
  manager (``KVCacheManager.pin``), which counts them in its integrity check.
- KV bytes of pinned blocks are read by peers without the step thread (NIXL reads memory
  directly; ``export_blocks`` copies it): ``PeerLeases`` (peer_leases.py) says why that is
  safe, and what peers may and may not pin.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.engine import ConnectorFactory, LLMEngine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.kv_connector import PullPlan
from kvmesh.workers.outputs import RequestOutput, StreamDelta
from kvmesh.workers.peer_leases import PeerLeases, ToStage
from kvmesh.workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.01


class Worker:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        connector: ConnectorFactory | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.engine = LLMEngine(config, connector, worker_id)
        self.kv = self.engine.kv
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._peer_commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = (
            queue.SimpleQueue()
        )
        self._wake = threading.Event()
        self.leases = PeerLeases(worker_id, self.kv, self.engine.kv_cache)
        self._stop = threading.Event()
        self._progress_at = time.monotonic()  # the step thread's last finished iteration
        self.kv.connector.attach(self._wake.set)
        self._thread = threading.Thread(target=self._loop, name=f"{worker_id}-step", daemon=True)
        self._thread.start()

    # -- the step thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(self._commands)
            self.serve_peers()
            ran = False
            if self.engine.has_unfinished():
                try:
                    self.engine.step()
                    ran = self.engine.last_batch_size > 0
                except Exception:  # a bug in a step must not kill the worker silently
                    logger.exception("engine step failed")
                    self._fail_all()
                    ran = True
            if not ran:  # idle, or every request waits on the connector: until it wakes us
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
            self._progress_at = time.monotonic()

    def check_health(self, stall_s: float) -> None:
        """Raise RuntimeError when the step thread has died, or has had work and finished no
        iteration for ``stall_s`` (wedged: a hung kernel, a deadlock)."""
        if not self._thread.is_alive():
            raise RuntimeError(f"{self.worker_id}: the step thread has died")
        stalled = time.monotonic() - self._progress_at
        if stalled > stall_s and self.engine.has_unfinished():
            raise RuntimeError(
                f"{self.worker_id}: the step thread made no progress for {stalled:.0f} s"
            )

    def serve_peers(self) -> None:
        """Run queued pin/release commands and release expired leases (step thread only)."""
        self._drain(self._peer_commands)
        self.leases.expire()

    @staticmethod
    def _drain(q: queue.SimpleQueue) -> None:
        while True:
            try:
                fn, fut = q.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)

    def _fail_all(self) -> None:
        for rid in self.engine.request_ids():
            self.engine.abort(rid, reason="error")

    # -- called from other threads ------------------------------------------------------------

    def call(self, fn: Callable[[], T], timeout: float | None = None, peer: bool = False) -> T:
        """Run ``fn`` on the step thread and return its result."""
        return self.submit(fn, peer).result(timeout)

    def submit(self, fn: Callable[[], T], peer: bool = False) -> Future[T]:
        """Queue ``fn`` for the step thread (commands run in order, between steps)."""
        fut: Future[T] = Future()
        (self._peer_commands if peer else self._commands).put((fn, fut))
        self._wake.set()
        return fut

    async def acall(self, fn: Callable[[], T], peer: bool = False) -> T:
        """``call`` for a coroutine: waits for the step thread without holding a thread."""
        return await asyncio.wrap_future(self.submit(fn, peer))

    async def astream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
        pull_plan: PullPlan | None = None,
        interval_s: float = 0.0,
        keepalive_s: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """Queue a request; yield its deltas as the step thread produces them. A coroutine
        waits for them, so a stream holds no thread: a worker actor serves as many streams
        as its caller sends on one event loop.

        ``resumed_token_ids``: output tokens another worker already streamed; the deltas go
        on from there (see ``LLMEngine.make_request``). ``pull_plan``: the router's plan for
        the prefix, for the connector. ``interval_s``: yield at most once per interval,
        each yield all the deltas that came since the last one, merged (the first at once:
        TTFT is not delayed; the last when the request finishes; a stream slower than the
        interval is not delayed at all). With no interval, deltas that piled up while the
        caller was busy still go as one.
        Every hop after this one (Ray, the ingress, the HTTP stream) costs per message, not
        per token; vLLM's output collector merges a lagging stream's outputs the same way.
        ``keepalive_s``: yield an empty delta (a keep-alive) after each ``keepalive_s`` with
        none to yield (queued, loading its prefix, a long prefill), so that a caller across
        the network tells a waiting request from a hung process (``cluster.liveness``); the
        waits and the step thread are apart, so a long step does not silence it.
        A stream closed or cancelled before its request finished aborts the request and
        frees its blocks, also one still waiting for its turn.
        """
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[StreamDelta] = asyncio.Queue()

        def on_delta(delta: StreamDelta) -> None:  # on the step thread
            # A stream whose loop is gone (a closed synchronous ``stream``) takes no more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(deltas.put_nowait, delta)

        # Validates, and replays resumed tokens through the detokenizer (a text prompt is
        # tokenized): off the loop, which other streams share.
        tracked = await asyncio.to_thread(
            self.engine.make_request,
            prompt,
            params,
            on_delta=on_delta,
            resumed_token_ids=resumed_token_ids,
            pull_plan=pull_plan,
        )
        rid = tracked.request.request_id
        queued = self.submit(lambda: self.engine.enqueue(tracked))
        finished = False
        last_yield = -math.inf
        try:
            # The step thread takes it between two steps, and a step may be long.
            waiting = asyncio.wrap_future(queued)
            while not (await asyncio.wait([waiting], timeout=keepalive_s))[0]:
                yield StreamDelta(rid)
            waiting.result()  # raises what enqueue raised (a request id already running)
            while not finished:
                due = last_yield + interval_s
                try:
                    async with asyncio.timeout(keepalive_s):
                        delta = await deltas.get()
                except TimeoutError:
                    yield StreamDelta(rid)  # a keep-alive: not the interval's, last_yield stays
                    continue
                # Merge what comes until the interval is over, or the request finishes.
                while delta.finish_reason is None:
                    try:
                        async with asyncio.timeout(max(0.0, due - loop.time())):
                            later = await deltas.get()
                    except TimeoutError:
                        break
                    delta = delta.merged(later)
                if delta.finish_reason == "error":
                    raise RuntimeError(f"{self.worker_id}: request {rid} failed in the engine")
                finished = delta.finish_reason is not None
                yield delta
                last_yield = loop.time()
        finally:
            # The caller went away: free the request's blocks. Commands keep their order, so
            # the abort runs after the enqueue; one whose enqueue failed is another's id.
            if not finished:
                await self.acall(lambda: None if queued.exception() else self.engine.abort(rid))

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[StreamDelta]:
        """``astream`` for a caller without an event loop (tests, scripts): the same
        deltas, each awaited on a loop of this generator's own."""
        loop = asyncio.new_event_loop()
        deltas = self.astream(*args, **kwargs)
        try:
            while True:
                try:
                    yield loop.run_until_complete(anext(deltas))
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(deltas.aclose())  # a stream closed early aborts here
            loop.close()

    async def agenerate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
        pull_plan: PullPlan | None = None,
    ) -> RequestOutput:
        stream = self.astream(
            prompt, params, resumed_token_ids=resumed_token_ids, pull_plan=pull_plan
        )
        async with contextlib.aclosing(stream):
            async for delta in stream:
                if delta.output is not None:
                    return delta.output
        raise RuntimeError("request ended without an output")

    def generate(self, *args: Any, **kwargs: Any) -> RequestOutput:
        """``agenerate`` for a caller without an event loop."""
        return asyncio.run(self.agenerate(*args, **kwargs))

    def pin(self, hashes: Sequence[BlockHash], lease_s: float) -> tuple[str, list[int]] | None:
        """Hold the cached blocks of ``hashes`` for a peer; (lease id, block ids) or None.

        The ids are those of the chain's longest head the pool has room to hold now (a pin
        may have to promote blocks into free ones) and ``PeerLeases``'s cap on pinned blocks
        allows, in order: the peer computes the rest. None when that head is empty or any
        of its hashes is no longer cached here, and None (refused, the peer computes
        instead) past ``PeerLeases``'s other limits (the lease's length, how many leases).
        The lease id is a secret: only its holder can read the blocks (``export_blocks``) or
        release them. Blocks the pool lacks but the tiers hold are promoted into the pool
        first; those kept only on disk are read here, on the caller's thread, between two
        calls into the step thread.
        """
        hashes = list(hashes)
        result = self.call(lambda: self.leases.grant(hashes, lease_s, None), peer=True)
        if isinstance(result, ToStage):  # part of it is on disk: read here, off the step thread
            staged = self.kv.connector.stage(result.hashes)
            result = self.call(lambda: self.leases.grant(hashes, lease_s, staged), peer=True)
        return None if isinstance(result, ToStage) else result

    def release(self, lease_id: str) -> None:
        self.call(lambda: self.leases.release(lease_id), peer=True)

    def export_blocks(self, lease_id: str, block_ids: Sequence[int]) -> np.ndarray:
        """``PeerLeases.export``: raises PermissionError unless the live lease ``lease_id``
        pins those blocks."""
        return self.leases.export(lease_id, block_ids)

    def cached_hashes(self) -> list[BlockHash]:
        return self.call(self.kv.cached_hashes)

    def num_leases(self) -> int:
        return self.call(lambda: len(self.leases.leases), peer=True)

    def num_pinned(self) -> int:
        """Blocks pinned by live leases now (each counted once)."""
        return self.call(lambda: len(self.leases.pinned), peer=True)

    def occupancy(self) -> dict[str, int]:
        """Queue lengths, for routers. ``running`` counts every admitted request, those
        waiting for their prefix's load (also ``loading``) included. ``room_blocks``: what
        the pool can give one request once the running ones finish (the pool less the blocks
        peers pinned)."""
        sched = self.engine.scheduler
        return self.call(
            lambda: {
                "running": len(sched.running) + len(sched.loading),
                "loading": len(sched.loading),
                "waiting": len(sched.waiting),
                "free_blocks": self.kv.num_free_blocks,
                "room_blocks": self.kv.num_blocks - len(self.leases.pinned),
            }
        )

    def shutdown(self) -> None:
        """Stop the step thread, then close the engine (its disk tier keeps the pool's blocks
        for the next start). A step thread that did not stop (wedged) may still change the
        pool: then the connector only closes."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            self.kv.connector.close()
        else:
            self.engine.close()
