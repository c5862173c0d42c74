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
from kvmesh.cluster.router import Router
from kvmesh.connector.cluster_connector import ClusterConnectorConfig
from kvmesh.connector.index_actor import get_index_actor
from kvmesh.workers.block_hash import block_hashes
from kvmesh.workers.chat import chat_prompt_ids, prompt_token_ids
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.loader import load_tokenizer
from kvmesh.workers.outputs import RequestOutput
from kvmesh.workers.worker_actor import worker_actor_class

logger = logging.getLogger(__name__)


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
        self.inflight: dict[str, list[list[bytes]]] = {w: [] for w in self.workers}
        self._route_lock = asyncio.Lock()
        self.dead: set[str] = set()

    # -- tokens -------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt, self.info["vocab_size"])

    def tokenize_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return chat_prompt_ids(self.tokenizer, messages)

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.messages is not None:
            return self.tokenize_chat(request.messages)
        assert request.prompt is not None
        return self.tokenize(request.prompt)

    # -- routing ------------------------------------------------------------------------------

    async def _choose(self, role: str, ids: list[int]) -> str:
        candidates = [w for w in self.roles[role] if w not in self.dead]
        depths: dict[str, int] = {}
        pending: dict[str, int] = {}
        if self.router.needs_lookup:
            hashes = block_hashes(ids, self.config.block_size, self.namespace)
            if self.index is not None:
                try:
                    depths = dict(await self.index.lookup.remote(hashes))
                except Exception as e:  # the index is a hint: route without it
                    logger.warning("index lookup failed: %s", e)
            # Prompts still prefilling: a request that shares their prefix goes to the same
            # worker and hits it a step later, instead of computing it again elsewhere.
            for w, chains in self.inflight.items():
                for chain in chains:
                    pending[w] = max(pending.get(w, 0), _common_prefix(chain, hashes))
        return self.router.choose(candidates, self.loads, len(ids), depths, pending).worker

    def _observe(self, worker: str, out: RequestOutput, queue: int) -> None:
        m = out.metrics
        if m.ttft_s is not None:
            self.router.cost.observe(
                m.ttft_s,
                m.num_computed_tokens,
                m.num_pulled_tokens // self.config.block_size,
                queue,
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
            chain = block_hashes(ids, self.config.block_size, self.namespace)
            # Choose and record as one step: concurrent requests must see each other's
            # choice (queue length, in-flight prefix), or a burst all lands the same way.
            async with self._route_lock:
                worker = await self._choose(role, ids)
                queue = self.loads[worker]
                self.loads[worker] += 1
                self.inflight[worker].append(chain)
            started = False
            try:
                gen = self.workers[worker].generate_stream.remote(ids, request.params)
                async for ref in gen:
                    delta = await ref
                    if not started:
                        self.inflight[worker].remove(chain)
                    started = True
                    chunk = Chunk(
                        request.request_id, delta.text, delta.token_ids, delta.finish_reason
                    )
                    if delta.output is not None:
                        self._observe(worker, delta.output, queue)
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
                if not started:
                    self.inflight[worker].remove(chain)

    async def _prefill(self, ids: list[int], request: GenerateRequest) -> str | None:
        """Compute the prompt's blocks on a prefill worker and publish them; None on failure
        (the decode worker then computes the prompt itself)."""
        try:
            worker = await self._choose("prefill", ids)
        except RuntimeError:
            return None
        handle = self.workers[worker]
        params = dataclasses.replace(request.params, max_tokens=1, stop=(), logprobs=None)
        self.loads[worker] += 1
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
