"""Which worker serves a request: ``kv_aware`` (lowest estimated TTFT), or the baselines.

The kv_aware cost model (docs/router.md) for a prompt of ``n`` full blocks on worker ``w``:

    local_w   = blocks w holds (index lookup depth for w)
    pull_w    = blocks a peer holds beyond local_w (max depth of the others - local_w, >= 0),
                only with the connector
    compute_w = n - local_w - pull_w, plus the partial last block
    ttft_w    = compute_w * block_size * t_token + pull_w * t_pull_block
                + queue_w * t_queue

``t_token`` (compute time per prompt token), ``t_pull_block`` (time per pulled block) and
``t_queue`` (time a queued request adds) are exponential moving averages of what finished
requests report: measured while running, never constants (they start from rough priors).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

PRIOR_T_TOKEN_S = 2e-3
PRIOR_T_PULL_BLOCK_S = 2e-4
PRIOR_T_QUEUE_S = 0.05
EMA = 0.2


@dataclass
class CostModel:
    t_token_s: float = PRIOR_T_TOKEN_S
    t_pull_block_s: float = PRIOR_T_PULL_BLOCK_S
    t_queue_s: float = PRIOR_T_QUEUE_S
    samples: dict[str, int] = field(default_factory=lambda: {"token": 0, "pull": 0, "queue": 0})

    def observe(
        self,
        ttft_s: float,
        computed_tokens: int,
        pulled_blocks: int,
        queue_len: int,
        pull_s: float | None = None,
    ) -> None:
        """Fold one finished request's TTFT into the estimates."""
        queue_part = queue_len * self.t_queue_s
        if pulled_blocks and pull_s is not None:
            self.t_pull_block_s = _ema(self.t_pull_block_s, pull_s / pulled_blocks)
            self.samples["pull"] += 1
        if computed_tokens:
            pull_part = pulled_blocks * self.t_pull_block_s
            per_token = max(ttft_s - pull_part - queue_part, 0.0) / computed_tokens
            self.t_token_s = _ema(self.t_token_s, per_token)
            self.samples["token"] += 1
        if queue_len:
            own = computed_tokens * self.t_token_s + pulled_blocks * self.t_pull_block_s
            self.t_queue_s = _ema(self.t_queue_s, max(ttft_s - own, 0.0) / queue_len)
            self.samples["queue"] += 1

    def estimate(
        self, num_blocks: int, block_size: int, local: int, pull: int, queue: int, partial: int
    ) -> float:
        compute_tokens = (num_blocks - local - pull) * block_size + partial
        return compute_tokens * self.t_token_s + pull * self.t_pull_block_s + queue * self.t_queue_s


def _ema(old: float, new: float) -> float:
    return (1 - EMA) * old + EMA * new


@dataclass(frozen=True)
class Choice:
    worker: str
    estimated_ttft_s: float | None = None
    local_blocks: int = 0
    pull_blocks: int = 0


class Router:
    def __init__(self, policy: str, block_size: int, connector: bool = True) -> None:
        if policy not in ("kv_aware", "round_robin", "least_loaded"):
            raise ValueError(f"router: unknown policy {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.connector = connector
        self.cost = CostModel()
        self._rr = itertools.count()

    @property
    def needs_lookup(self) -> bool:
        return self.policy == "kv_aware"

    def choose(
        self,
        candidates: Sequence[str],
        loads: dict[str, int],
        num_prompt_tokens: int = 0,
        depths: dict[str, int] | None = None,
        pending: dict[str, int] | None = None,
    ) -> Choice:
        """Pick one of ``candidates`` (non-empty). ``loads``: running + waiting per worker;
        ``depths``: the index's prefix depth per worker; ``pending``: the prefix depth of
        prompts a worker is computing right now (kv_aware only). Pending blocks count as
        local to their worker (its scheduler makes the request wait a step and hit them) but
        not as pullable: nobody holds them yet."""
        if not candidates:
            raise RuntimeError("no worker is available")
        if self.policy == "round_robin":
            return Choice(candidates[next(self._rr) % len(candidates)])
        if self.policy == "least_loaded":
            return Choice(min(candidates, key=lambda w: (loads.get(w, 0), w)))
        depths, pending = depths or {}, pending or {}
        # The last token is always computed, so only (n - 1) // block_size blocks can hit.
        num_blocks = max(num_prompt_tokens - 1, 0) // self.block_size
        partial = num_prompt_tokens - num_blocks * self.block_size
        best = max(depths.values(), default=0)
        options = []
        for w in candidates:
            local = min(max(depths.get(w, 0), pending.get(w, 0)), num_blocks)
            pull = max(min(best, num_blocks) - local, 0) if self.connector else 0
            ttft = self.cost.estimate(
                num_blocks, self.block_size, local, pull, loads.get(w, 0), partial
            )
            options.append((ttft, loads.get(w, 0), w, local, pull))
        ttft, _, w, local, pull = min(options)
        return Choice(w, ttft, local, pull)
