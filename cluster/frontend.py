"""``ClusterBackend``: the ``Backend`` of a stateless ingress replica over the worker deployments.

Per request it tokenizes once, hashes the prompt's blocks once, gives a sampled request
without a seed one (so a resumed stream draws what the unbroken one would have), and sends a
``WorkerRequest`` through a Serve handle; the worker deployment's request router picks the
replica. It keeps no routing state of its own, so any number of ingress replicas route alike
(what is being computed where lives in the index as pending entries).

Under prefill/decode disaggregation the prompt first runs on a prefill replica (one token),
whose blocks the decode replica then pulls; a failed prefill only costs time.

Migration: when a worker replica is lost mid-request (it died, or was drained past its
deadline), the request resumes on another replica with the prompt plus the tokens generated
so far; the client sees one stream. After ``max_migrations`` moves it fails with
``WorkerLostError``, which names the cause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import random
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.serve import context as serve_context

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest, Unavailable
from kvmesh.cluster.backend_tokens import TokenMethods
from kvmesh.cluster.cluster_stats import ClusterStats
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.liveness import SILENT_PERIODS, LostWorkers, WorkerSilent, live_deltas
from kvmesh.cluster.worker_deployment import READY_TIMEOUT_S
from kvmesh.cluster.worker_request import WorkerRequest
from kvmesh.workers.bad_words import with_bad_words_token_ids
from kvmesh.workers.block_hash import block_hashes, cache_namespace
from kvmesh.workers.outputs import StreamDelta
from kvmesh.workers.tokenizer_loader import load_tokenizer

logger = logging.getLogger(__name__)
SHUTTING_DOWN = "the server is shutting down; retry on another server"
# How often a worker reports the progress of an answer sent whole (a migration resumes from
# the last report; a cancelled request is aborted within about this long).
PROGRESS_INTERVAL_S = 1.0


class WorkerLostError(Unavailable):
    """A request's worker was lost more often than ``max_migrations`` allows."""


def _is_lost(e: BaseException) -> bool:
    """What a lost worker replica looks like to a caller: the replica or its engine actor
    died or is unreachable (RayActorError, which ActorDiedError and ActorUnavailableError
    subclass), also when wrapped in the replica's RayTaskError, or its call went silent (its
    process hung or cut off: ``liveness``)."""
    lost = (RayActorError, WorkerSilent)
    return isinstance(e, lost) or isinstance(getattr(e, "cause", None), RayActorError)


def _current_actor() -> Any:
    """This process's own actor handle (the ingress replica's), or None outside an actor."""
    try:
        return ray.get_runtime_context().current_actor
    except RuntimeError:
        return None


class ClusterBackend(TokenMethods):
    """``handles`` maps each role ("worker", or "prefill" and "decode") to its deployment."""

    def __init__(self, config: ServeConfig, handles: dict[str, Any]) -> None:
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = load_tokenizer(config.model)
        self.handles = handles
        self.role = "decode" if config.disaggregated else "worker"
        # The model's identity, from a worker (the namespace of the block hashes is the
        # workers' fingerprint). A thread: Serve's handles refuse sync calls on a loop.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            self.info: dict[str, Any] = pool.submit(
                lambda: handles[self.role].worker_info.remote().result(timeout_s=READY_TIMEOUT_S)
            ).result()
        self.max_model_len: int = self.info["max_model_len"]
        self.vocab_size: int = self.info["vocab_size"]
        self.namespace: bytes = self.info["namespace"]
        self._stats = ClusterStats(self.info["fingerprint"]) if config.connector else None
        self.caller = _current_actor()
        self.draining = False  # the app is stopping: new requests are refused
        self._ended = False  # the drain is over: running requests end too
        self._running: set[Any] = set()  # the worker calls of the requests running here
        self._loop: asyncio.AbstractEventLoop | None = None  # where requests run
        # A worker call that sent nothing, not even a keep-alive, this long is lost.
        self._silent_s = config.health_check_period_s * SILENT_PERIODS
        # The workers this ingress lost calls on lately: every request it sends carries them
        # in ``lost_on``, so the routers send it elsewhere while another replica is listed and
        # kv_aware plans no pull from them.
        self._lost = LostWorkers(config.health_check_period_s, config.health_stall_s)

    def drain(self, drain_s: float) -> None:
        """The app is stopping: refuse each new request (``Unavailable``, a 503) and end the
        ones still running ``drain_s`` from now the same way (an SSE error event once a
        stream started), before Serve kills this replica and its callers would get the
        proxy's bare 500 or a cut stream. From any thread."""
        if self.draining:
            return
        self.draining = True
        loop = self._loop
        if loop is not None:  # else no request ever ran here: none to end
            loop.call_soon_threadsafe(loop.call_later, drain_s, self._end_running)

    def _end_running(self) -> None:
        self._ended = True
        for call in list(self._running):
            call.cancel()  # the worker aborts it, as when a client leaves

    def _worker_request(
        self,
        request: GenerateRequest,
        ids: list[int],
        resumed: list[int],
        interval_s: float,
        lost_on: Sequence[str] = (),
    ) -> WorkerRequest:
        namespace = cache_namespace(self.namespace, request.params.cache_salt)
        chain = block_hashes([*ids, *resumed], self.config.block_size, namespace)
        return WorkerRequest(
            request.request_id,
            ids,
            request.params,
            chain,
            list(resumed),
            fingerprint=self.info["fingerprint"] if self.config.connector else None,
            caller=self.caller,
            lost_on=tuple(dict.fromkeys([*lost_on, *self._lost.members()])),
            interval_s=interval_s,
        )

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Completion:
        final: Completion | None = None
        # Nobody reads the pieces of an answer sent whole: the worker reports progress (what
        # a migration resumes from) once a PROGRESS_INTERVAL_S, not per token.
        async for chunk in self.stream(request, PROGRESS_INTERVAL_S):
            final = chunk.completion or final
        assert final is not None
        return final

    async def stream(
        self, request: GenerateRequest, interval_s: float | None = None
    ) -> AsyncIterator[Chunk]:
        """The request's chunks; at most one per ``interval_s`` (default: the config's
        ``stream_interval_s``)."""
        self._loop = asyncio.get_running_loop()
        if self.draining:
            raise Unavailable(SHUTTING_DOWN)
        if interval_s is None:
            interval_s = self.config.stream_interval_s
        # The chat template and the tokenizer are CPU work: off the event loop.
        ids = await asyncio.to_thread(self.prompt_ids, request)
        params = request.params
        if params.bad_words and not params.bad_words_token_ids:  # the handle's: tokenized here
            params = await asyncio.to_thread(
                with_bad_words_token_ids, params, self.tokenizer, self.vocab_size
            )
            request = dataclasses.replace(request, params=params)
        if not params.greedy and params.seed is None:
            # A seed of its own: randomness is a function of (seed, position), so a request
            # resumed on another worker draws exactly what the unbroken one would have.
            params = dataclasses.replace(params, seed=random.getrandbits(63))
            request = dataclasses.replace(request, params=params)
        prefill_worker = None
        # Prompt logprobs need every prompt position's logits where the prompt is computed, so
        # such a request computes it where it decodes: a prefill replica's KV would not do.
        if self.config.disaggregated and params.prompt_logprobs is None:
            prefill_worker = await self._prefill(request, ids)
        generated: list[int] = []
        logprobs: list[dict[int, float]] = []
        prompt_logprobs: list[dict[int, float] | None] | None = None
        migrations = 0
        lost_on: list[str] = []  # the workers it was lost on: not routed there again
        while True:
            if self._ended:
                raise Unavailable(SHUTTING_DOWN)
            asked = request
            if prompt_logprobs is not None:  # resumed: they came, so hits may serve again
                asked = dataclasses.replace(
                    request, params=dataclasses.replace(params, prompt_logprobs=None)
                )
            work = self._worker_request(asked, ids, generated, interval_s, lost_on)
            own_call_id()
            stream = self.handles[self.role].options(stream=True).generate.remote(work)
            self._running.add(stream)
            finished = False
            worker = None
            try:
                async for delta in live_deltas(stream, self._silent_s):
                    worker = delta.worker or worker
                    if delta.is_empty:
                        continue  # a keep-alive
                    generated.extend(delta.token_ids)
                    logprobs.extend(delta.logprobs or [])
                    if delta.prompt_logprobs is not None:
                        prompt_logprobs = delta.prompt_logprobs
                    chunk = Chunk(
                        request.request_id,
                        delta.text,
                        list(delta.token_ids),
                        delta.finish_reason,
                        logprobs=delta.logprobs,
                        prompt_logprobs=delta.prompt_logprobs,
                    )
                    if delta.output is not None:
                        chunk.completion = self._completion(
                            request, ids, delta, generated, logprobs, prefill_worker, migrations
                        )
                        chunk.completion.prompt_logprobs = prompt_logprobs
                    finished = delta.finish_reason is not None
                    yield chunk
                    if finished:
                        return
                raise RayActorError()  # the stream ended without a finish: the worker went
            except Exception as e:
                if self._ended or (self.draining and _is_lost(e)):
                    # Ended by the drain, or a worker stopped with the app: nowhere to move.
                    raise Unavailable(SHUTTING_DOWN) from None
                if not _is_lost(e):
                    raise
                migrations += 1
                # Where it ran: its deltas (keep-alives too) say; before any came, where the
                # router sent it.
                worker = worker or work.routed_to
                if worker is not None:
                    lost_on.append(worker)
                    self._lost.add(worker)
                if migrations > self.config.max_migrations:
                    raise WorkerLostError(
                        f"request {request.request_id}: its worker was lost {migrations} times "
                        f"(max_migrations {self.config.max_migrations}); last: "
                        f"{type(e).__name__}"
                    ) from None
                logger.warning(
                    "request %s: worker %s lost (%s) after %d tokens; resuming on another (%d/%d)",
                    request.request_id,
                    worker or "unknown",
                    type(e).__name__,
                    len(generated),
                    migrations,
                    self.config.max_migrations,
                )
            finally:
                self._running.discard(stream)
                if not finished:
                    # Closed at ``yield`` (the client left while a chunk was on its way), no
                    # cancellation reached the worker call: cancel it, or it runs on for nobody.
                    stream.cancel()

    def _completion(
        self,
        request: GenerateRequest,
        ids: list[int],
        delta: StreamDelta,
        generated: list[int],
        logprobs: list[dict[int, float]],
        prefill_worker: str | None,
        migrations: int,
    ) -> Completion:
        """The whole answer, across the workers it ran on (the last one's KV sources)."""
        out = delta.output
        assert out is not None
        worker = delta.worker or "?"
        completion = Completion.of(request.request_id, worker, out, prefill_worker)
        completion.prompt_token_ids = list(ids)
        completion.token_ids = list(generated)
        completion.logprobs = logprobs if request.params.logprobs is not None else None
        completion.kv.migrations = migrations
        return completion

    async def _prefill(self, request: GenerateRequest, ids: list[int]) -> str | None:
        """Compute the prompt's blocks on a prefill replica and publish them; the worker's
        name, or None when none took it within ``prefill_wait_s`` or it failed (the decode
        worker then computes the prompt itself: a lost prefill replica costs time, never a
        request, and requests do not queue behind its replacement's start)."""
        # One token, sampled and dropped: what only the decode reads goes (min_tokens above 1
        # would not even validate, and a grammar would be compiled for nothing).
        params = dataclasses.replace(
            request.params,
            max_tokens=1,
            min_tokens=0,
            stop=(),
            logprobs=None,
            structured_outputs=None,
        )
        work = self._worker_request(dataclasses.replace(request, params=params), ids, [], 0.0)
        own_call_id()
        stream = self.handles["prefill"].options(stream=True).generate.remote(work)
        worker, done = None, False
        try:
            # The replica's first (empty) delta says it took the prompt.
            worker = (await asyncio.wait_for(anext(stream), self.config.prefill_wait_s)).worker
            async for delta in live_deltas(stream, self._silent_s):
                if delta.output is not None:
                    done = True
                    return delta.worker
        except TimeoutError:
            logger.warning(
                "no prefill replica took the prompt within %.1f s; decode computes it",
                self.config.prefill_wait_s,
            )
        except Exception as e:
            if _is_lost(e) and worker is not None:
                self._lost.add(worker)
            logger.warning("prefill failed (%s); decode computes the prompt", type(e).__name__)
        finally:
            if not done:  # timed out, lost, or its caller left: it must not run for nobody
                stream.cancel()
        return None

    # -- observability ------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """The cluster's stats (``ClusterStats``); empty without the connector."""
        return await self._stats.read() if self._stats is not None else {}

    def shutdown(self) -> None:
        """Nothing to stop: Serve owns the workers."""


def own_call_id() -> None:
    """Give the next Serve handle call an id of its own.

    Serve's router tracks a call it is placing by the caller's request context
    (``internal_request_id``), which every call made while serving one HTTP request shares.
    Calls placed at the same time to one deployment, such as the choices of an ``n > 1``
    request, then collide: Ray 2.60's router keeps one of them and the others never reach a
    replica (the request hangs). The logged ``request_id`` stays the HTTP request's.
    """
    ctx = serve_context._get_serve_request_context()
    fresh = dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex)
    serve_context._serve_request_context.set(fresh)
