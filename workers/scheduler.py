"""Continuous batching: which requests run this step, and how many tokens each.

Each step mixes decodes and (chunked) prefills under a token budget. Running requests go
first, in arrival order; when the pool has no room for one, the most recently started running
request is preempted (its blocks freed, its tokens recomputed later). Waiting requests are
admitted only when no preemption happened this step, so a starved pool drains first.

A request whose prefix comes from outside the pool (a peer, another tier) is admitted with its
blocks allocated and its load started, and then waits in ``loading`` while the other
requests keep running; it joins the batch at the first step after its load ended (the tokens
a failed load did not fill are computed). A request the connector is still looking up for
stays in ``waiting`` and is asked about again next step; the requests behind it go ahead.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from kvmesh.workers.kv_cache_manager import KVCacheManager
from kvmesh.workers.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests in one step
    max_num_batched_tokens: int = 1024  # tokens in one step; longer prompts are chunked

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # computed this step, starting at request.num_kv_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a token is sampled."""
        return self.request.num_kv_tokens + self.num_new_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}  # admitted, waiting for their load to end
        self._load_started: dict[str, float] = {}  # their loads' start (perf_counter)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        """Requests to run or wait for, or connector results still to collect."""
        return bool(self.waiting or self.running or self.loading) or self.kv.awaits_connector

    def schedule(self) -> list[ScheduledRequest]:
        self._collect_loads()
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_kv_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                batch.append(ScheduledRequest(req, n))
                budget -= n
                i += 1

        # Blocks that running requests are about to compute: a waiting request whose next
        # missing block is among them waits a step and then hits it, instead of computing the
        # same KV twice (e.g. many requests arriving at once with one system prompt).
        pending = self._pending_blocks() if self.waiting and not preempted else set()
        j = 0
        while (
            not preempted
            and j < len(self.waiting)
            and budget > 0
            and len(self.running) + len(self.loading) < self.config.max_num_seqs
        ):
            req = self.waiting[j]
            computed = self.kv.get_computed_blocks(req)
            if computed is None:  # the connector is still looking: ask again next step
                j += 1
                continue
            local = len(computed.local_blocks)
            found = local + computed.num_external_blocks
            cacheable = min(len(req.block_hashes), (req.num_tokens - 1) // self.kv.block_size)
            # Blocks that requests here compute or load now: wait a step (or a load) and hit
            # them, rather than computing or pulling them a second time.
            if (found < cacheable and req.block_hashes[found] in pending) or (
                local < found and req.block_hashes[local] in pending
            ):
                j += 1
                continue
            hit = found * self.kv.block_size
            started = time.perf_counter()
            alloc = self.kv.allocate_slots(req, min(req.num_tokens - hit, budget), computed)
            if alloc is None:
                break
            if alloc.num_loaded_tokens and req.metrics.first_token_time is None:
                req.metrics.kv_load_s = time.perf_counter() - started  # loaded in the call
            del self.waiting[j]
            req.num_kv_tokens = alloc.num_kv_tokens
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
            self._record_sources(
                req,
                alloc.num_local_hit_tokens,
                alloc.num_loaded_tokens,
                alloc.loaded_medium,
                alloc.loaded_disk_tokens,
            )
            pending.update(req.block_hashes[req.num_kv_tokens // self.kv.block_size :])
            if alloc.num_loading_tokens:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KV
                self.loading[req.request_id] = req
                self._load_started[req.request_id] = started
                continue
            # A failed load leaves more to compute; the blocks allocated already cover it.
            n = min(req.num_tokens - req.num_kv_tokens, budget)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append(ScheduledRequest(req, n))
            budget -= n
        return batch

    def _collect_loads(self) -> None:
        """Requests whose load ended join the running ones (or start over, see
        ``LoadOutcome.restart``)."""
        for outcome in self.kv.poll_loads():
            req = outcome.request
            if self.loading.get(req.request_id) is not req:
                continue
            del self.loading[req.request_id]
            started = self._load_started.pop(req.request_id, None)
            m = req.metrics
            if m.first_token_time is None:
                if started is not None:
                    m.kv_load_s = time.perf_counter() - started
                if outcome.read_blocks:  # one peer's link only if every read was from it
                    one = m.num_read_blocks == 0 or m.read_from == outcome.read_from
                    m.read_from = outcome.read_from if one else None
                m.num_read_blocks += outcome.read_blocks
                m.read_s += outcome.read_s
            if outcome.restart:
                req.num_kv_tokens = 0
                req.status = RequestStatus.WAITING
                self.waiting.appendleft(req)
                continue
            req.num_kv_tokens += outcome.num_loaded_tokens
            self._record_sources(
                req,
                req.metrics.num_local_hit_tokens,
                outcome.num_loaded_tokens,
                outcome.medium,
                outcome.disk_tokens,
            )
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    @staticmethod
    def _record_sources(
        req: Request,
        local_tokens: int,
        loaded_tokens: int,
        medium: str = "peer",
        disk_tokens: int = 0,
    ) -> None:
        """Where the KV of the admission that yields the first token comes from: the pool,
        a load from ``medium`` (a peer, or local tiers: ``disk_tokens`` of it from disk, the
        rest from host memory), the rest computed."""
        m = req.metrics
        if m.first_token_time is not None:
            return
        tiers = medium != "peer"
        m.num_local_hit_tokens = local_tokens
        m.num_pulled_tokens = 0 if tiers else loaded_tokens
        m.num_host_hit_tokens = loaded_tokens - disk_tokens if tiers else 0
        m.num_disk_hit_tokens = disk_tokens if tiers else 0
        # num_tokens: the prompt, and a resumed request's resumed tokens, all prefilled.
        m.num_computed_tokens = req.num_tokens - local_tokens - loaded_tokens

    def _pending_blocks(self) -> set[bytes]:
        """Hashes of full blocks that running requests have yet to compute, or loading
        requests to load or compute."""
        bs = self.kv.block_size
        pending: set[bytes] = set()
        for req in [*self.running, *self.loading.values()]:
            pending.update(req.block_hashes[req.num_kv_tokens // bs :])
        return pending

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_kv_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Drop a finished (or aborted) request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif self.loading.get(req.request_id) is req:
            del self.loading[req.request_id]  # its blocks are freed when the load ends
            self._load_started.pop(req.request_id, None)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
