"""One engine driven by a step thread, with pins for peers: the body of a worker actor.

Thread model (written down because three kinds of threads meet here):

- The step thread owns the engine: scheduler, block pool, KV cache manager, model. Nothing
  else touches them. It loops: run queued commands, release expired leases, ``engine.step()``.
- Caller threads (the Ray actor's concurrency group, or a test) never touch the engine: they
  enqueue a command and wait on its future (``call``), or wait on a request's delta queue.
- Peer commands (``pin`` / ``release``) go on a separate queue, which the step thread also
  serves from inside a blocking ``connector.load`` (through the ``service`` function it
  attaches to the connector). So two workers pulling from each other cannot deadlock.
- KV bytes of pinned blocks are read by peers without the step thread (NIXL reads memory
  directly; ``export_blocks`` copies it): pinned blocks are full and cached, so no step
  writes them while the lease holds.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.block_pool import KVBlock
from kvmesh.workers.engine import ConnectorFactory, LLMEngine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.outputs import RequestOutput, StreamDelta
from kvmesh.workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_WAIT_S = 0.01


@dataclass
class Lease:
    blocks: list[KVBlock]
    expires_at: float


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
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count()
        self._stop = threading.Event()
        self._progress_at = time.monotonic()  # the step thread's last finished iteration
        self.kv.connector.attach(self.serve_peers)
        self._thread = threading.Thread(target=self._loop, name=f"{worker_id}-step", daemon=True)
        self._thread.start()

    # -- the step thread --------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain(self._commands)
            self.serve_peers()
            if self.engine.has_unfinished():
                try:
                    self.engine.step()
                except Exception:  # a bug in a step must not kill the worker silently
                    logger.exception("engine step failed")
                    self._fail_all()
            else:
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
        now = time.monotonic()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at < now]:
            logger.warning("%s: lease %d expired; releasing", self.worker_id, lease_id)
            self._release(lease_id)

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
        fut: Future = Future()
        (self._peer_commands if peer else self._commands).put((fn, fut))
        self._wake.set()
        return fut.result(timeout)

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
    ) -> Iterator[StreamDelta]:
        """Queue a request; yield its deltas as the step thread produces them.

        ``resumed_token_ids``: output tokens another worker already streamed; the deltas go
        on from there (see ``LLMEngine.make_request``).
        """
        deltas: queue.SimpleQueue[StreamDelta] = queue.SimpleQueue()
        # Validates, and replays resumed tokens through the detokenizer, on this thread.
        tracked = self.engine.make_request(
            prompt, params, on_delta=deltas.put, resumed_token_ids=resumed_token_ids
        )
        rid = self.call(lambda: self.engine.enqueue(tracked))
        finished = False
        try:
            while not finished:
                delta = deltas.get()
                if delta.finish_reason == "error":
                    raise RuntimeError(f"{self.worker_id}: request {rid} failed in the engine")
                finished = delta.finish_reason is not None
                yield delta
        finally:
            if not finished:  # the caller went away: free the request's blocks
                self.call(lambda: self.engine.abort(rid))

    def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
    ) -> RequestOutput:
        for delta in self.stream(prompt, params, resumed_token_ids=resumed_token_ids):
            if delta.output is not None:
                return delta.output
        raise RuntimeError("request ended without an output")

    def pin(self, hashes: Sequence[BlockHash], lease_s: float) -> tuple[int, list[int]] | None:
        """Hold the cached blocks of ``hashes`` for a peer; (lease id, block ids) or None.

        All or nothing: None when any hash is no longer cached here.
        """
        return self.call(lambda: self._pin(list(hashes), lease_s), peer=True)

    def release(self, lease_id: int) -> None:
        self.call(lambda: self._release(lease_id), peer=True)

    def _pin(self, hashes: list[BlockHash], lease_s: float) -> tuple[int, list[int]] | None:
        blocks = [self.kv.pool.get_cached_block(h) for h in hashes]
        if any(b is None for b in blocks):
            return None
        held = [b for b in blocks if b is not None]
        self.kv.pool.touch(held)
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = Lease(held, time.monotonic() + lease_s)
        return lease_id, [b.block_id for b in held]

    def _release(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.kv.pool.free_blocks(lease.blocks[::-1])

    def export_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """The KV bytes of (pinned) blocks, in order: `KVCache.export_blocks`."""
        return self.engine.kv_cache.export_blocks(block_ids)

    def cached_hashes(self) -> list[BlockHash]:
        return self.call(lambda: list(self.kv.pool.cached))

    def num_leases(self) -> int:
        return self.call(lambda: len(self._leases), peer=True)

    def load(self) -> dict[str, int]:
        """Queue lengths, for routers."""
        return self.call(
            lambda: {
                "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting),
                "free_blocks": self.kv.pool.num_free_blocks,
            }
        )

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        self.kv.connector.close()
