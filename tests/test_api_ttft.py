"""TTFT on /metrics is the client's: from the request's arrival at the ingress, so time spent
before a worker takes it (waiting for a replica, a prefill elsewhere) counts. The response's
``kvmesh.ttft_ms`` stays the worker's own. The wait is injected on purpose: a backend that
sleeps before handing the request on."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from typing import Any

from kvmesh.cluster.backend import Chunk, Completion, GenerateRequest
from kvmesh.cluster.local_backend import LocalBackend
from kvmesh.cluster.openai_api import build_api
from tests.openai_helpers import MODEL, USER, call, serve

WAIT_S = 0.6


class Late:
    """The backend, reached ``WAIT_S`` late (as when no worker replica is up yet)."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def generate(self, request: GenerateRequest) -> Completion:
        await asyncio.sleep(WAIT_S)
        return await self.inner.generate(request)

    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        await asyncio.sleep(WAIT_S)
        async for chunk in self.inner.stream(request):
            yield chunk


def ttft_histogram(port: int) -> tuple[float, float]:
    status, text = call(port, "GET", "/metrics")
    assert status == 200
    count = re.search(r"^kvmesh_time_to_first_token_seconds_count (\S+)$", text, re.M)
    total = re.search(r"^kvmesh_time_to_first_token_seconds_sum (\S+)$", text, re.M)
    assert count and total, text
    return float(count.group(1)), float(total.group(1))


def test_ttft_on_metrics_counts_the_wait_before_a_worker(backend: LocalBackend) -> None:
    body = {"model": MODEL, "messages": USER, "max_tokens": 24, "temperature": 0}
    with serve(build_api(Late(backend), model_name=MODEL)) as port:
        status, whole = call(port, "POST", "/v1/chat/completions", body)
        assert status == 200, whole
        status, text = call(port, "POST", "/v1/chat/completions", {**body, "stream": True})
        assert status == 200
        worker_ttfts = [whole["kvmesh"]["ttft_ms"] / 1000]
        events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: {")]
        worker_ttfts += [e["kvmesh"]["ttft_ms"] / 1000 for e in events if "kvmesh" in e]
        count, total = ttft_histogram(port)
    assert count == 2 and len(worker_ttfts) == 2
    # Each observation holds the injected wait; the worker's own TTFT does not (before: the
    # histogram observed the worker's TTFT, so the sum stayed below the waits).
    assert all(t < WAIT_S for t in worker_ttfts), worker_ttfts
    assert total >= 2 * WAIT_S, (total, worker_ttfts)
    # ... and not the whole response: the 24 tokens' decode is taken off a whole response.
    assert total < 2 * WAIT_S + sum(worker_ttfts) + 1.0, (total, worker_ttfts)
