"""``ClusterBackend``: the ``Backend`` over Ray worker actors, the index and the router.

It starts the workers (unified, or prefill + decode roles), tokenizes, asks the index where a
prompt's blocks are, lets the router pick a worker, and, under prefill/decode disaggregation,
runs the prompt on a prefill worker first (one token) so the decode worker pulls its blocks.
A failed prefill worker only costs time: the decode worker computes the prompt itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest
from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.router import Router, WorkerView
from kvmesh.connector.cluster_connector import ClusterConnectorConfig
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.chat import chat_prompt_ids, prompt_token_ids, token_texts
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.loader import load_tokenizer
from kvmesh.workers.outputs import RequestOutput
from kvmesh.workers.worker_actor import worker_actor_class

logger = logging.getLogger(__name__)

# Longest a request waits for a peer's in-flight prefix before it is sent anyway.
PENDING_WAIT_S = 120.0


@dataclasses.dataclass(eq=False)
class _Inflight:
    """A prompt routed to a worker that has not produced its first token yet."""

    chain: list[bytes]
    tokens: int  # prompt tokens the router expects the worker to compute
    queue: int  # requests on the worker when routed (for the cost model)
    backlog: int  # prompt tokens routed to the worker before this one and not computed yet
    submitted: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # blocks published
    waiters: int = 0

    def done(self) -> None:
        self.submitted.set()
        self.ready.set()


@dataclasses.dataclass
class _Pending:
    """A worker's prompts in flight, seen from one new prompt."""

    backlog: int = 0  # prompt tokens they have left to compute
    depth: int = 0  # most leading blocks one of them shares with the new prompt
    wait_tokens: int = 0  # backlog up to and including that one
    entry: _Inflight | None = None  # that one


class ClusterBackend:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = load_tokenizer(config.model)
        engine = EngineConfig(
            model=config.model,
            block_size=config.block_size,
            kv_cache_memory=config.kv_cache_memory,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            device=config.device,
            dtype=config.dtype,
            progress=False,
        )
        conn = ClusterConnectorConfig(transport=config.transport) if config.connector else None
        cls = worker_actor_class(config.num_gpus_per_worker, config.num_cpus_per_worker)
        threads = max(1, int(config.num_cpus_per_worker))
        roles = (
            [("prefill", config.prefill_workers), ("decode", config.decode_workers)]
            if config.disaggregated
            else [("worker", config.num_unified_workers)]
        )
        self.workers: dict[str, Any] = {}
        self.roles: dict[str, list[str]] = {}
        for role, n in roles:
            names = [f"{role}-{i}" for i in range(n)]
            self.roles[role] = names
            for name in names:
                self.workers[name] = cls.options(name=None).remote(name, engine, conn, threads)
        infos = ray.get([h.ready.remote() for h in self.workers.values()])
        self.info = infos[0]
        self.max_model_len = self.info["max_model_len"]
        self.namespace: bytes = self.info["namespace"]
        self.index = get_index_actor(self.info["fingerprint"]) if config.connector else None
        self.router = Router(config.router, config.block_size, config.connector)
        self.loads: dict[str, int] = dict.fromkeys(self.workers, 0)
        self.inflight: dict[str, list[_Inflight]] = {w: [] for w in self.workers}
        self._route_lock = asyncio.Lock()
        self.dead: set[str] = set()

    # -- tokens -------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt, self.info["vocab_size"])

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return token_texts(self.tokenizer, ids)

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            return self.tokenize_chat(request.messages)
        assert request.prompt is not None
        return self.tokenize(request.prompt)

    # -- routing ------------------------------------------------------------------------------

    def _pending(self, worker: str, chain: list[bytes]) -> _Pending:
        """The prompts in flight on ``worker``, seen from a prompt with block hashes ``chain``."""
        pending = _Pending()
        for e in self.inflight[worker]:  # in routing order: a worker computes its prompts FIFO
            pending.backlog += e.tokens
            depth = _common_prefix(e.chain, chain)
            if depth > pending.depth:
                pending.depth, pending.wait_tokens, pending.entry = depth, pending.backlog, e
        return pending

    async def _views(
        self, chain: list[bytes], pending: dict[str, _Pending]
    ) -> dict[str, WorkerView]:
        if not self.router.needs_lookup:
            return {w: WorkerView(queue=q) for w, q in self.loads.items()}
        depths: dict[str, int] = {}
        if self.index is not None:
            try:
                depths = dict(await self.index.lookup.remote(chain))
            except Exception as e:  # the index is a hint: route without it
                logger.warning("index lookup failed: %s", e)
        return {
            w: WorkerView(self.loads[w], p.backlog, depths.get(w, 0), p.depth, p.wait_tokens)
            for w, p in pending.items()
        }

    async def _route(self, role: str, ids: list[int]) -> tuple[str, _Inflight]:
        """Choose a worker and record the prompt as in flight there (one step, under a lock:
        concurrent requests must see each other's choices, or a burst all lands the same
        way), then wait until what the choice relies on is there. The caller must call
        ``_finish_route`` once the worker has computed the prompt (or failed)."""
        candidates = [w for w in self.roles[role] if w not in self.dead]
        chain = block_hashes(ids, self.config.block_size, self.namespace)
        async with self._route_lock:
            pending = {w: self._pending(w, chain) for w in self.inflight}
            choice = self.router.choose(candidates, await self._views(chain, pending), len(ids))
            worker = choice.worker
            # Prompts that share this prefix and were routed to the same worker first go
            # first: its scheduler then makes this one wait a step and hit their blocks.
            ahead = pending[worker].entry
            peer = pending[choice.wait_for].entry if choice.wait_for else None
            queue, backlog = self.loads[worker], pending[worker].backlog
            entry = _Inflight(chain, choice.compute_tokens, queue, backlog)
            self.loads[worker] += 1
            self.inflight[worker].append(entry)
        try:
            if peer is not None:
                peer.waiters += 1
                await asyncio.wait_for(peer.ready.wait(), PENDING_WAIT_S)
            if ahead is not None:
                await asyncio.wait_for(ahead.submitted.wait(), PENDING_WAIT_S)
        except TimeoutError:
            logger.warning("waited %.0f s for an in-flight prefix; sending anyway", PENDING_WAIT_S)
        except BaseException:  # cancelled while waiting: the request never reached a worker
            self.loads[worker] -= 1
            await self._finish_route(worker, entry)
            raise
        entry.submitted.set()
        return worker, entry

    async def _finish_route(self, worker: str, entry: _Inflight) -> None:
        """The worker computed the prompt (or gave up): publish its blocks for waiters."""
        try:
            if entry in self.inflight[worker]:
                self.inflight[worker].remove(entry)
                if entry.waiters and self.index is not None and worker not in self.dead:
                    await self.workers[worker].connector_call.remote("flush")
        except Exception as e:  # the waiters then compute what they cannot pull
            logger.warning("flush on %s failed: %s", worker, e)
        finally:
            entry.done()

    def _observe(self, out: RequestOutput, queue: int, backlog: int) -> None:
        m = out.metrics
        if m.ttft_s is not None:
            self.router.cost.observe(
                m.ttft_s,
                m.num_computed_tokens,
                m.num_pulled_tokens // self.config.block_size,
                queue,
                backlog_tokens=backlog,
            )

    # -- requests -----------------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> Completion:
        final: Completion | None = None
        async for chunk in self.stream(request):
            final = chunk.completion or final
        assert final is not None
        return final

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        ids = self.prompt_ids(request)
        prefill_worker = None
        if self.config.disaggregated:
            prefill_worker = await self._prefill(ids, request)
        role = "decode" if self.config.disaggregated else "worker"
        for attempt in range(2):  # a worker that dies before its first token: try another
            worker, entry = await self._route(role, ids)
            started = False
            try:
                gen = self.workers[worker].generate_stream.remote(ids, request.params)
                async for ref in gen:
                    delta = await ref
                    if not started:
                        await self._finish_route(worker, entry)
                    started = True
                    chunk = Chunk(
                        request.request_id,
                        delta.text,
                        delta.token_ids,
                        delta.finish_reason,
                        logprobs=delta.logprobs,
                    )
                    if delta.output is not None:
                        self._observe(delta.output, entry.queue, entry.backlog)
                        chunk.completion = Completion.of(
                            request.request_id, worker, delta.output, prefill_worker
                        )
                    yield chunk
                if self.index is not None:  # publish its blocks now, for the next request
                    await self.workers[worker].connector_call.remote("flush")
                return
            except ray.exceptions.RayActorError:
                self.dead.add(worker)
                if started or attempt == 1:
                    raise
                logger.warning("%s died before answering; retrying on another worker", worker)
            finally:
                self.loads[worker] -= 1
                await self._finish_route(worker, entry)

    async def _prefill(self, ids: list[int], request: GenerateRequest) -> str | None:
        """Compute the prompt's blocks on a prefill worker and publish them; None on failure
        (the decode worker then computes the prompt itself)."""
        try:
            worker, entry = await self._route("prefill", ids)
        except RuntimeError:
            return None
        handle = self.workers[worker]
        params = dataclasses.replace(request.params, max_tokens=1, stop=(), logprobs=None)
        try:
            await handle.generate.remote(ids, params)
            await handle.connector_call.remote("flush")  # the index must see the blocks
            return worker
        except Exception as e:
            if isinstance(e, ray.exceptions.RayActorError):
                self.dead.add(worker)
            logger.warning("prefill on %s failed (%s); decode computes the prompt", worker, e)
            return None
        finally:
            self.loads[worker] -= 1
            await self._finish_route(worker, entry)

    # -- observability ------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        live = {w: h for w, h in self.workers.items() if w not in self.dead}
        loads = await asyncio.gather(
            *(h.load.remote() for h in live.values()), return_exceptions=True
        )
        workers = {w: ld for w, ld in zip(live, loads, strict=True) if isinstance(ld, dict)}
        out: dict[str, Any] = {"workers": workers}
        if self.index is not None:
            out["index_blocks"] = (await self.index.stats.remote()).get("blocks", 0)
            conns = await asyncio.gather(
                *(h.connector_call.remote("get_stats") for h in live.values()),
                return_exceptions=True,
            )
            good = [c for c in conns if isinstance(c, dict)]
            out["pull_bytes"] = sum(c.get("pulled_bytes", 0) for c in good)
            out["pull_failures"] = sum(c.get("pull_failures", 0) for c in good)
        return out

    def shutdown(self) -> None:
        for h in self.workers.values():
            try:
                ray.get(h.shutdown.remote(), timeout=10)
            except Exception:
                logger.debug("worker already gone at shutdown")
            ray.kill(h)


def _common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
