"""The per-request state that the KV cache manager and the scheduler share."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from typing import Any

from kvmesh.workers.block_hash import BlockHash, BlockHasher
from kvmesh.workers.kv_connector import PullPlan
from kvmesh.workers.outputs import RequestMetrics


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # admitted; its prefix is being loaded
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """A sequence of prompt tokens and the tokens generated after them.

    ``block_hashes`` grows with the sequence: every full block, prompt or output, gets a
    chained hash, so decoded blocks can be cached and shared too.

    ``resumed_token_ids`` are output tokens generated elsewhere (a request cut off on another
    worker): they start ``output_token_ids`` and are prefilled with the prompt, since their KV
    is not here (a prefix hit or pull can still supply it: their blocks hash as usual).

    ``pull_plan``: where the cluster router said the prefix can be pulled from (see
    ``PullPlan``); None when no plan came, and the connector looks for itself.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_size: int,
        namespace: bytes,
        params: Any = None,
        resumed_token_ids: Sequence[int] = (),
        pull_plan: PullPlan | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must hold at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = list(resumed_token_ids)
        self.num_resumed_tokens = len(self.output_token_ids)
        self.params = params
        self.status = RequestStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=time.perf_counter())
        # Tokens whose KV is in this request's blocks (local hits + pulled + computed).
        self.num_kv_tokens = 0
        self.pull_plan = pull_plan
        # False after a load whose transfer could not be stopped: compute everything instead.
        self.may_pull = True
        self._hasher = BlockHasher(block_size, namespace)
        self._hasher.extend(self.prompt_token_ids)
        self._hasher.extend(self.output_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether every prompt position's logits are needed (prompt logprobs): then every
        prompt token is computed here, with no hit, pull or tier load, which give KV only."""
        return getattr(self.params, "prompt_logprobs", None) is not None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def block_hashes(self) -> list[BlockHash]:
        """Hashes of every full block of ``all_token_ids`` (do not mutate)."""
        return self._hasher.hashes

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._hasher.extend((token_id,))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_kv_tokens}, {self.status.value})"
        )
