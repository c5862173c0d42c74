"""For the asynchronous-load tests: prompts, a connector whose loads wait behind a gate, and a
driver that steps an engine and counts what each request streamed."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from kvmesh import SamplingParams
from kvmesh.workers.block_hash import BlockHash
from kvmesh.workers.engine import ConnectorContext, LLMEngine
from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.kv_connector import InMemoryKvCacheConnector, LoadResult, PullPlan
from kvmesh.workers.outputs import RequestOutput

BS = 4
NUM_BLOCKS = 64
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


PREFIX = prompt(1, 41)  # 10 full blocks come from the connector, the last token is computed
OTHER = prompt(2, 9)
PEER = "w-peer"  # the peer every load of GatedConnector reads from


class GatedConnector(InMemoryKvCacheConnector):
    """The in-memory store behind a slow link (a fault injected on purpose): every load runs
    on a thread of its own and does nothing until the test opens ``gate``. Then, by ``mode``:
    ``ok`` writes the blocks; ``fail`` scribbles over them and fails; ``writing`` scribbles,
    fails with the transfer still running, and scribbles again once ``transfer_over`` is set
    (the late bytes of a transfer that cannot be stopped), then says it is over. Each result
    reports its blocks as read from ``PEER``, over the time from its start (as a transport's
    read would)."""

    def __init__(self, kv_cache: KVCache) -> None:
        super().__init__(kv_cache.read_block, kv_cache.write_block)
        self.kv_cache = kv_cache
        self.mode = "ok"
        self.gate = threading.Event()
        self.transfer_over = threading.Event()
        self.block_ids: dict[int, list[int]] = {}  # load id -> its blocks
        self._results: queue.SimpleQueue[LoadResult] = queue.SimpleQueue()

    def start_load(
        self,
        load_id: int,
        hashes: Sequence[BlockHash],
        block_ids: Sequence[int],
        plan: PullPlan | None = None,
    ) -> LoadResult | None:
        payloads = [self.store.get(h) for h in hashes]  # the store is the step thread's
        self.block_ids[load_id] = list(block_ids)
        args = (load_id, payloads, list(block_ids))
        threading.Thread(target=self._run, args=args, daemon=True).start()
        return None

    def _run(self, load_id: int, payloads: list[bytes | None], block_ids: list[int]) -> None:
        started = time.perf_counter()
        self.gate.wait()
        seconds = time.perf_counter() - started
        reads = {"read_blocks": len(block_ids), "read_s": seconds, "read_from": PEER}
        if self.mode == "ok" and all(p is not None for p in payloads):
            for block_id, payload in zip(block_ids, payloads, strict=True):
                assert payload is not None
                self.writer(block_id, payload)
            self._results.put(LoadResult(load_id, len(block_ids), **reads))
        elif self.mode == "writing":
            self._scribble(block_ids[:1])
            self._results.put(LoadResult(load_id, 0, writing=True, **reads))
            self.transfer_over.wait()
            self._scribble(block_ids)  # lands in blocks the manager must not have reused
            self._results.put(LoadResult(load_id, 0, writing=False))
        else:
            self._scribble(block_ids)
            self._results.put(LoadResult(load_id, 0, **reads))

    def _scribble(self, block_ids: list[int]) -> None:
        n = self.kv_cache.block_bytes_all_layers // 4
        noise = (np.random.default_rng(0).standard_normal(n) * 4).astype(np.float32)
        for block_id in block_ids:
            self.kv_cache.write_block(block_id, noise.tobytes())

    def poll_loads(self) -> list[LoadResult]:
        out = []
        while not self._results.empty():
            out.append(self._results.get())
        return out


def config() -> EngineConfig:
    return EngineConfig("tiny-random", block_size=BS, num_kv_blocks=NUM_BLOCKS, progress=False)


def gated(ctx: ConnectorContext) -> GatedConnector:
    return GatedConnector(ctx.kv_cache)


class Driver:
    """Steps an engine and keeps, per request, the tokens streamed so far and the output."""

    def __init__(self, eng: LLMEngine) -> None:
        self.eng = eng
        self.tokens: dict[str, int] = {}
        self.outputs: dict[str, RequestOutput] = {}

    def step(self) -> None:
        for delta in self.eng.step():
            self.tokens[delta.request_id] = self.tokens.get(delta.request_id, 0) + len(
                delta.token_ids
            )
            if delta.output is not None:
                self.outputs[delta.request_id] = delta.output
        if self.eng.last_batch_size == 0:
            time.sleep(0.001)  # everything waits on the connector's thread

    def until(self, done: Callable[[], bool], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, "timed out"
            self.step()

    def finish(self, rids: list[str]) -> dict[str, RequestOutput]:
        self.until(lambda: all(r in self.outputs for r in rids))
        return self.outputs


def primed() -> tuple[LLMEngine, GatedConnector, Driver]:
    """An engine whose connector holds PREFIX's blocks while its own pool does not."""
    eng = LLMEngine(config(), gated)
    conn = eng.kv.connector
    assert isinstance(conn, GatedConnector)
    d = Driver(eng)
    d.finish([eng.add_request(PREFIX, GREEDY)])
    assert eng.kv.reset_prefix_cache()  # the local copy is gone; the connector keeps its own
    return eng, conn, d


def key(ids: list[int], params: SamplingParams) -> tuple[int, ...]:
    return (*ids, params.max_tokens)


def reference_tokens() -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of each prompt, computed from scratch by an engine without a connector."""
    eng = LLMEngine(config())
    want = {}
    for ids, params in ((PREFIX, GREEDY), (OTHER, LONG), (OTHER, GREEDY)):
        rid = eng.add_request(ids, params)
        want[key(ids, params)] = Driver(eng).finish([rid])[rid].token_ids
    return want
