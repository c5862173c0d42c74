"""Continuous batching: which requests run this step, and how many tokens each.

Each step mixes decodes and (chunked) prefills under a token budget. Running requests go
first, in arrival order; when the pool has no room for one, the most recently started running
request is preempted (its blocks freed, its tokens recomputed later). Waiting requests are
admitted only when no preemption happened this step, so a starved pool drains first.
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
    num_new_tokens: int  # computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRequest]:
        budget = self.config.max_num_batched_tokens
        batch: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
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
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[j]
            computed = self.kv.get_computed_blocks(req)
            found = len(computed.local_blocks) + computed.num_external_blocks
            cacheable = min(len(req.block_hashes), (req.num_tokens - 1) // self.kv.block_size)
            if found < cacheable and req.block_hashes[found] in pending:
                j += 1
                continue
            hit = found * self.kv.block_size
            alloc = self.kv.allocate_slots(req, min(req.num_tokens - hit, budget), computed)
            if alloc is None:
                break
            del self.waiting[j]
            req.num_computed_tokens = alloc.num_computed_tokens
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.perf_counter()
                req.metrics.num_cached_tokens = alloc.num_local_hit_tokens
                req.metrics.num_pulled_tokens = alloc.num_loaded_tokens
                # num_tokens: the prompt, and a resumed request's resumed tokens, all prefilled.
                req.metrics.num_computed_tokens = req.num_tokens - alloc.num_computed_tokens
            # A failed load leaves more to compute; the blocks allocated already cover it.
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            pending.update(req.block_hashes[req.num_computed_tokens // self.kv.block_size :])
            batch.append(ScheduledRequest(req, n))
            budget -= n
        return batch

    def _pending_blocks(self) -> set[bytes]:
        """Hashes of full blocks that running requests have yet to compute."""
        bs = self.kv.block_size
        pending: set[bytes] = set()
        for req in self.running:
            pending.update(req.block_hashes[req.num_computed_tokens // bs :])
        return pending

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Drop a finished (or aborted) request and free its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.FINISHED
