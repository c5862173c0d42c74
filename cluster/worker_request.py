"""What the ingress sends a worker replica: one request, tokenized and hashed once.

The ingress builds a ``WorkerRequest`` (prompt token ids, the prompt's block-hash chain, the
sampling parameters and, after a migration, the tokens generated so far); the request router
reads the chain to route it and writes its ``Plan`` into it before Serve sends it to the
chosen replica, so the worker knows what the router counted on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.workers.sampling_params import SamplingParams


@dataclass
class Plan:
    """The router's decision for one request on one worker."""

    worker: str  # the replica's worker name
    local_blocks: int = 0  # leading blocks the worker holds or is computing
    pull_blocks: int = 0  # blocks beyond those that a peer holds (or will, after waiting)
    compute_tokens: int = 0  # prompt tokens the worker is expected to compute
    holder: str | None = None  # the peer to pull from
    wait_for: str | None = None  # a peer computing the prefix now: wait until it is stored
    wait_blocks: int = 0  # how many leading blocks to wait for on ``wait_for``
    pending_id: int | None = None  # this request's pending entry in the index
    queue: int = 0  # requests on the worker when routed (for the cost model)


@dataclass
class WorkerRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # Block hashes of prompt_ids + resumed_ids (full blocks), computed once at the ingress.
    chain: list[bytes] = field(default_factory=list)
    # Output tokens another worker generated before it was lost (a migration).
    resumed_ids: list[int] = field(default_factory=list)
    plan: Plan | None = None
    fingerprint: str | None = None  # the model's, which names its index (for the router)
    # The sender's actor handle (an ingress replica): Ray does not cancel an actor task whose
    # caller died, so the worker aborts the request itself once this actor is gone.
    caller: Any = None
    # At most one message per interval back to the ingress (``Worker.stream``): a stream's
    # ``stream_interval_s``, or for an answer sent whole the ingress's progress interval.
    interval_s: float = 0.0
    # Workers this request was lost on (dead, or silent: ``liveness``). Serve lists a hung
    # replica until its health checks fail, so the routers send a migration elsewhere.
    lost_on: tuple[str, ...] = ()
    # The worker kvmesh's router chose first (Serve takes another of its ranked choices only
    # when that one is full): where a call lost before it sent anything ran.
    routed_to: str | None = None

    @property
    def num_context_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.resumed_ids)
