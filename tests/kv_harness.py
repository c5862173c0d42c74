"""A test harness that drives a KVCacheManager the way the engine's scheduler does.

KV "bytes" live in a dict block_id -> bytes. Computing a full block writes that block's hash
into it, which stands for the real KV: it depends on the block's tokens and its whole prefix.
So ``check_kv`` proves that no request ever reads a block holding another prefix's KV.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvmesh.workers.kv_allocation import Allocation
from kvmesh.workers.kv_cache import host_bytes_tensor
from kvmesh.workers.kv_cache_manager import KVCacheManager
from kvmesh.workers.kv_connector import BlockBytes, KvCacheConnector
from kvmesh.workers.request import Request

NAMESPACE = b"test-model"


class KvHarness:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        make_connector: Callable[[KvHarness], KvCacheConnector] | None = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.memory: dict[int, bytes] = {}
        connector = make_connector(self) if make_connector else None
        self.manager = KVCacheManager(num_blocks, block_size, connector, enable_prefix_caching)
        self.requests: dict[str, Request] = {}

    def read(self, block_id: int) -> bytes:
        return self.memory[block_id]

    def read_into(self, block_id: int, out: torch.Tensor) -> None:
        out.copy_(host_bytes_tensor(self.memory[block_id]))

    def write(self, block_id: int, data: BlockBytes | torch.Tensor) -> None:
        self.memory[block_id] = host_bytes_tensor(data).numpy().tobytes()

    def new_request(self, rid: str, tokens: list[int]) -> Request:
        req = Request(rid, tokens, self.manager.block_size, NAMESPACE)
        self.requests[rid] = req
        return req

    def prefill(self, req: Request) -> Allocation | None:
        """Schedule the whole prompt in one step; compute and cache what is new."""
        computed = self.manager.get_computed_blocks(req)
        hit = (len(computed.local_blocks) + computed.num_external_blocks) * self.manager.block_size
        alloc = self.manager.allocate_slots(req, req.num_tokens - hit, computed)
        if alloc is None:
            return None
        req.num_kv_tokens = alloc.num_kv_tokens
        if alloc.num_loading_tokens:  # a background load: wait for it, as the request does
            req.num_kv_tokens += self.wait_load(req)
        self.compute(req, req.num_tokens - req.num_kv_tokens)
        return alloc

    def wait_load(self, req: Request, timeout_s: float = 10.0) -> int:
        """Poll until ``req``'s background load ends; the tokens it loaded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for outcome in self.manager.poll_loads():
                assert outcome.request is req and not outcome.restart
                return outcome.num_loaded_tokens
            time.sleep(0.001)
        raise AssertionError(f"{req.request_id}: its load never ended")

    def decode(self, req: Request, token: int) -> bool:
        """Append a sampled token and compute it; when the pool is full, preempt instead.

        A preempted request holds no blocks and computes everything again on its next
        ``prefill``, as the engine does.
        """
        req.append_output_token(token)
        if self.manager.allocate_slots(req, 1) is None:
            self.manager.free(req)
            req.num_kv_tokens = 0
            return False
        self.compute(req, 1)
        return True

    def compute(self, req: Request, n: int) -> None:
        """Write KV for ``n`` tokens after the computed prefix, then register full blocks."""
        bs = self.manager.block_size
        ids = self.manager.get_block_ids(req)
        end = req.num_kv_tokens + n
        for i in range(req.num_kv_tokens // bs, end // bs):
            self.memory[ids[i]] = req.block_hashes[i]
        req.num_kv_tokens = end
        self.manager.cache_blocks(req, end)

    def finish(self, req: Request) -> None:
        self.manager.free(req)
        del self.requests[req.request_id]

    def check_kv(self) -> None:
        """Every full computed block a live request holds carries that request's prefix KV."""
        bs = self.manager.block_size
        for req in self.requests.values():
            ids = self.manager.get_block_ids(req)
            for i in range(req.num_kv_tokens // bs):
                assert self.memory.get(ids[i]) == req.block_hashes[i], (
                    f"{req.request_id} block {i} (id {ids[i]}) holds the wrong KV"
                )
            for i, bid in enumerate(ids[: len(req.block_hashes)]):
                h = self.manager.pool.blocks[bid].block_hash
                assert h is None or h == req.block_hashes[i], "hit on a block of another hash"
