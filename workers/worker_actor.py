"""The worker as a Ray actor: a thin wrapper over ``Worker`` (see its thread model).

The actor is asynchronous: a stream is a coroutine waiting for its request's deltas, not a
thread, so an engine actor serving hundreds of streams runs a few dozen threads (it ran ~330
as a threaded actor, a thread per stream its caller may send). Its methods run in three
concurrency groups, each on an event loop of its own, so no kind of call can starve another:
streams (the default group), ``peers`` (pins, releases and block exports from pulling peers)
and ``control`` (health checks, load, stats, flushes). A full house of long streams must not
make the health check time out (Serve would kill a healthy worker) nor a peer's pull wait.
So no method blocks its loop: a stream awaits its deltas, and a call that waits for the
step thread or takes a thread's work (a copy of KV bytes, a disk read, a Ray call) runs in
the loop's executor, a few threads reused. Only ``Worker``'s step thread touches the engine.
Ray ends an asynchronous stream only once its caller acknowledged every item, on the loop
(``WaitAllObjectsReported``): a caller stopped at that moment holds the streams' loop until
it resumes or dies. The only caller of ``generate_stream`` in a cluster is the replica that
owns this actor (``WorkerDeployment``), whose pause is this worker's anyway; the control and
peers groups' loops go on.

This module stays light (no torch, no engine at import): deserializing an actor handle makes
Ray import its class's module, and the index actor receives every worker's handle. With torch
imported here, a new index stalled ~3 s on its first ``register`` (each rejoin after an index
loss waited for it) and held ~180 MB of torch it never uses. ``Worker`` and torch load in
``__init__``, in the worker's own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any

import ray

from kvmesh.workers.block_hash import BlockHash, block_hashes, cache_namespace
from kvmesh.workers.kv_connector import PullPlan
from kvmesh.workers.outputs import RequestOutput, StreamDelta
from kvmesh.workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np

    from kvmesh.workers.engine import ConnectorFactory
    from kvmesh.workers.engine_config import EngineConfig

MAX_STREAMS = 64  # streams at once, unless the caller says how many it may send
PEER_BLOCKS_TIMEOUT_S = 30.0  # how long ``peer_blocks`` waits for the connector's answer
CONCURRENCY_GROUPS = {"peers": 16, "control": 8}
_peers = ray.method(concurrency_group="peers")
_control = ray.method(concurrency_group="control")


class WorkerActor:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        connector: ConnectorFactory | None = None,
        num_threads: int | None = None,
    ) -> None:
        import torch

        from kvmesh.workers.worker import Worker

        # CPU workers share the host's cores: each takes its share, or all of them slow down.
        if num_threads is not None:
            torch.set_num_threads(max(1, num_threads))
        self.worker = Worker(worker_id, config, connector)
        self._checked_at = time.monotonic()  # the last ``health`` call: its replica's check

    @_control
    async def ready(self) -> dict[str, Any]:
        eng = self.worker.engine
        return {
            "worker_id": self.worker.worker_id,
            "pid": os.getpid(),
            "fingerprint": eng.fingerprint.id,
            "namespace": eng.fingerprint.namespace,
            "num_blocks": eng.kv.num_blocks,
            "block_size": eng.config.block_size,
            "max_model_len": eng.max_model_len,
            "vocab_size": eng.model_config.vocab_size,
        }

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
        pull_plan: PullPlan | None = None,
    ) -> RequestOutput:
        return await self.worker.agenerate(
            prompt, params, resumed_token_ids=resumed_token_ids, pull_plan=pull_plan
        )

    async def generate_stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        resumed_token_ids: Sequence[int] = (),
        pull_plan: PullPlan | None = None,
        interval_s: float = 0.0,
        keepalive_s: float | None = None,
    ) -> AsyncIterator[StreamDelta]:
        """The request's deltas as they come, at most one per ``interval_s``, and an empty
        one after each ``keepalive_s`` without any (see ``Worker.astream``). ``pull_plan``:
        the router's plan for the prefix, used by the connector unless stale. A caller that
        went away (a closed HTTP stream) cancels this task (``ray.cancel``): the stream
        aborts the request and frees its blocks at once."""
        stream = self.worker.astream(
            prompt,
            params,
            resumed_token_ids=resumed_token_ids,
            pull_plan=pull_plan,
            interval_s=interval_s,
            keepalive_s=keepalive_s,
        )
        async with contextlib.aclosing(stream):
            async for delta in stream:
                yield delta

    @_peers
    async def pin(
        self, hashes: Sequence[BlockHash], lease_s: float
    ) -> tuple[str, list[int]] | None:
        return await asyncio.to_thread(self.worker.pin, hashes, lease_s)

    @_peers
    async def release(self, lease_id: str) -> None:
        await asyncio.to_thread(self.worker.release, lease_id)

    @_peers
    async def export_blocks(self, lease_id: str, block_ids: Sequence[int]) -> np.ndarray:
        """The bytes of blocks under the caller's live lease; PermissionError otherwise
        (copied in the loop's executor: megabytes, and the GIL is released)."""
        return await asyncio.to_thread(self.worker.export_blocks, lease_id, block_ids)

    @_control
    async def cached_hashes(self) -> list[BlockHash]:
        return await asyncio.to_thread(self.worker.cached_hashes)

    @_control
    async def num_leases(self) -> int:
        return await asyncio.to_thread(self.worker.num_leases)

    @_control
    async def num_pinned(self) -> int:
        return await asyncio.to_thread(self.worker.num_pinned)

    @_control
    async def occupancy(self) -> dict[str, int]:
        return await asyncio.to_thread(self.worker.occupancy)

    @_control
    async def confirm_pending(
        self, pending_id: int, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> bool:
        """A router's pending entry says this worker computes the prompt ``token_ids`` (its
        resumed tokens included; ``cache_salt`` the request's) now: the connector confirms it
        with the hashes of those tokens, hashed here, so an entry for blocks this worker was
        not sent stays brief. Hashed in the executor too: a long prompt's chain is CPU work
        the control group's loop (health checks) should not wait behind."""
        eng = self.worker.engine

        def confirm() -> bool:
            namespace = cache_namespace(eng.fingerprint.namespace, cache_salt)
            hashes = block_hashes(token_ids, eng.config.block_size, namespace)
            return self.worker.kv.connector.confirm_pending(pending_id, hashes)

        return await asyncio.to_thread(confirm)

    @_control
    async def flush_events(self) -> int:
        """Publish this worker's buffered index events now; how many batches went out."""
        return await asyncio.to_thread(self.worker.kv.connector.flush)

    @_control
    async def peer_blocks(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the connector offers (a peer's, or this
        worker's own tiers'): its lookup, on the step thread, asked again until it knows (it
        looks up on a thread of its own)."""
        hashes = list(hashes)
        deadline = time.monotonic() + PEER_BLOCKS_TIMEOUT_S
        while True:
            n = await self.worker.acall(lambda: self.worker.kv.connector.lookup(hashes))
            if n is not None:
                return n
            if time.monotonic() > deadline:
                return 0
            await asyncio.sleep(0.005)

    @_control
    async def connector_stats(self) -> dict[str, float]:
        return self.worker.kv.connector.get_stats()

    @_control
    async def health(self, stall_s: float) -> None:
        """Raises when the step thread died or made no progress for ``stall_s`` with work.
        Its replica calls it each health-check period (``answers`` counts on that)."""
        self._checked_at = time.monotonic()
        self.worker.check_health(stall_s)

    @_control
    async def answers(self, stall_s: float, within_s: float) -> bool:
        """Whether this worker would serve a request now: its step thread is fine, and its
        replica called ``health`` within ``within_s`` (a stopped replica stops calling). An
        ingress asks a worker it lost a call on, to route requests there again."""
        try:
            self.worker.check_health(stall_s)
        except RuntimeError:
            return False
        return time.monotonic() - self._checked_at <= within_s

    @_control
    async def shutdown(self) -> None:
        await asyncio.to_thread(self.worker.shutdown)


def worker_actor_class(
    num_gpus: float | None = None, num_cpus: float = 1, max_streams: int = MAX_STREAMS
) -> Any:
    """``WorkerActor`` as a Ray actor class; ``num_gpus`` defaults to 1 when Ray sees a GPU.
    ``max_streams``: streams at once (coroutines: no thread each); Ray queues a call past
    them, and a queued call says nothing, not even a keep-alive."""
    if num_gpus is None:
        num_gpus = 1 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) else 0
    return ray.remote(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_concurrency=max_streams,
        concurrency_groups=CONCURRENCY_GROUPS,
    )(WorkerActor)
