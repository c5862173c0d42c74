"""Which worker serves a request: ``kv_aware`` (lowest estimated cost), or the baselines.

The kv_aware cost model (docs/router.md) for a prompt of ``n`` full blocks on worker ``w``:

    local_w   = blocks w holds or is computing right now (index depth, in-flight prefixes)
    pull_w    = blocks a peer holds beyond local_w, or, after waiting for it, a peer is
                computing (only with the connector)
    tier_w    = blocks beyond local_w in w's own host / disk tiers (index depth per medium),
                used when no peer holds more (the worker loads the larger source)
    compute_w = n - local_w - tier_w - pull_w blocks, plus the partial last block
    ttft_w    = max(wait_w, backlog_w * t_token) + compute_w * block_size * t_token
                + pull_w * t_pull_block + host_w * t_host_block + disk_w * t_disk_block
                + promoted_w * t_tier_block + queue_w * t_queue

``promoted_w`` are the pulled blocks the holder keeps in its tiers, not its pool: it copies
them into its pool under the pin before the read, the same copy as a load from its host tier
(``t_host_block``) or its disk (``t_disk_block``), charged as such.
    cost_w    = ttft_w + (duplicate_w + moved_w) * block_size * t_token

``wait_w`` is how long until the peer's in-flight prefix is computed and published;
``backlog_w`` the prompt tokens already routed to w and not computed yet. The two extra terms
are what the request costs the rest of the cluster: ``duplicate_w`` blocks computed that a peer
is computing at the same time, and ``moved_w`` pulled blocks that only one peer holds (a
conversation's own history, not a shared prompt): moving a conversation strands its history
on the old worker and grows the new worker's working set, and once pools are full that is
paid back as a recompute.

``t_token`` (compute time per prompt token), ``t_pull_block`` (time per pulled block),
``t_host_block`` / ``t_disk_block`` (time per block loaded from a tier) and ``t_queue`` (time a
queued request adds) are exponential moving averages of what finished requests report:
measured while running, never constants (they start from rough priors; ``CostModel`` in
cluster/cost_model.py). Each worker measures
its own, and each worker is charged its own (``Router.learn``): a worker on a faster device
computes for less, and one behind a slower disk loads for more. The holder's costs price what
the holder does (promoting blocks for a pin, computing a prefix another worker waits for).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.cluster.cost_model import CostModel, worker_costs
from kvmesh.connector.holder_sets import nearest_holder, pullable_depth


@dataclass(frozen=True)
class WorkerView:
    """What the frontend knows about one worker when it routes one prompt."""

    queue: int = 0  # requests routed there and not finished
    backlog_tokens: int = 0  # prompt tokens routed there and not computed yet
    depth: int = 0  # leading blocks of this prompt it holds (from the index)
    pending: int = 0  # leading blocks of this prompt it is computing now
    pending_wait_tokens: int = 0  # its backlog up to and including that computation
    # Blocks its pool can give one request once its running requests finish: the pool less
    # what peers pinned (None: unknown). Running requests' blocks come back; the queue term
    # prices that wait, so they set no worker aside (a conversation would leave its history).
    room_blocks: int | None = None
    # Leading blocks it holds in its pool or host tier, and in any of pool, host, disk (the
    # index's depths per medium, cumulative: depth <= host_depth <= disk_depth when known).
    host_depth: int = 0
    disk_depth: int = 0
    node: str | None = None  # the Ray node its KV lives on (peers there pull locally)

    @property
    def pull_depth(self) -> int:
        """Leading blocks a peer can pull from it (:func:`pullable_depth`)."""
        return pullable_depth(self.depth, {"host": self.host_depth, "disk": self.disk_depth})


@dataclass(frozen=True)
class Choice:
    worker: str
    estimated_ttft_s: float | None = None
    local_blocks: int = 0
    pull_blocks: int = 0
    compute_tokens: int = 0  # prompt tokens the worker is expected to compute
    wait_for: str | None = None  # send only once this peer's in-flight prefix is published


@dataclass(frozen=True)
class _Option:
    cost: float
    ttft: float
    local: int
    pull: int
    compute_tokens: int
    wait_for: str | None


class Router:
    def __init__(self, policy: str, block_size: int, connector: bool = True) -> None:
        if policy not in ("kv_aware", "round_robin", "least_loaded"):
            raise ValueError(f"router: unknown policy {policy!r}")
        self.policy = policy
        self.block_size = block_size
        self.connector = connector
        # The costs of a worker that reported none of its own: the mean of those that did
        # (the priors at first); ``worker_costs`` holds each reporting worker's (``learn``).
        self.cost = CostModel()
        self.worker_costs: dict[str, CostModel] = {}
        self._rr = itertools.count()

    def learn(self, reports: Mapping[str, Mapping[str, Any]]) -> None:
        """Take each worker's measured costs from its report (``worker_costs``)."""
        self.worker_costs = worker_costs(reports, self.cost)

    def cost_of(self, worker: str) -> CostModel:
        """The costs ``worker`` measured, or the cluster's mean when it reported none."""
        return self.worker_costs.get(worker, self.cost)

    def pick_holder(
        self, worker: str, depths: Mapping[str, int], nodes: Mapping[str, str | None]
    ) -> str | None:
        """The peer ``worker`` pulls from, given how many of the prompt's blocks each can
        give and each worker's node: :func:`nearest_holder`, over the links ``worker``
        measured."""
        others = {p: d for p, d in depths.items() if p != worker}
        return nearest_holder(
            others, nodes.get(worker), nodes, self.cost_of(worker).t_pull_block_from
        )

    def hit_blocks(self, num_prompt_tokens: int) -> int:
        """The prompt's blocks a cache can give: the last token is always computed (for its
        logits), so only (tokens - 1) // block_size."""
        return max(num_prompt_tokens - 1, 0) // self.block_size

    @property
    def needs_lookup(self) -> bool:
        return self.policy == "kv_aware"

    def choose(
        self,
        candidates: Sequence[str],
        views: Mapping[str, WorkerView],
        num_prompt_tokens: int = 0,
    ) -> Choice:
        """Pick one of ``candidates`` (non-empty). ``views`` may leave out workers it knows
        nothing about. Blocks a worker is computing count as local to it (its scheduler makes
        a request that shares them wait a step and hit), and as pullable by the others only
        after they wait for them to be published."""
        if not candidates:
            raise RuntimeError("no worker is available")
        if self.policy == "round_robin":
            return Choice(candidates[next(self._rr) % len(candidates)])
        empty = WorkerView()
        n = self.hit_blocks(num_prompt_tokens)
        partial = num_prompt_tokens - n * self.block_size
        candidates = self._with_room(candidates, views, n)
        if self.policy == "least_loaded":
            return Choice(min(candidates, key=lambda w: (views.get(w, empty).queue, w)))
        best: tuple[tuple[float, int, str], str, _Option] | None = None
        nodes = {name: v.node for name, v in views.items()}
        for w in candidates:
            v = views.get(w, empty)
            for opt in self._options(w, v, views, nodes, n, partial):
                key = (opt.cost, v.queue, w)
                if best is None or key < best[0]:
                    best = (key, w, opt)
        assert best is not None
        _, w, opt = best
        return Choice(w, opt.ttft, opt.local, opt.pull, opt.compute_tokens, opt.wait_for)

    @staticmethod
    def _with_room(
        candidates: Sequence[str], views: Mapping[str, WorkerView], n: int
    ) -> Sequence[str]:
        """The candidates whose pool can take this prompt's blocks beyond those they hold:
        a worker whose pool peers pinned would only hold it until their leases end (while
        the others have room). All of them when none has room or none is known."""
        empty = WorkerView()

        def room(w: str) -> bool:
            v = views.get(w, empty)
            return v.room_blocks is None or v.room_blocks >= n + 1 - min(v.depth, n)

        fit = [w for w in candidates if room(w)]
        return fit or candidates

    def _options(
        self,
        w: str,
        v: WorkerView,
        views: Mapping[str, WorkerView],
        nodes: Mapping[str, str | None],
        n: int,
        partial: int,
    ) -> list[_Option]:
        """Serve now (pulling what peers hold, or computing it), or wait for a peer's
        in-flight prefix."""
        local = min(max(v.depth, v.pending), n)
        others = {name: p for name, p in views.items() if name != w}
        # Peers' depths, deepest first: beyond the second deepest, one peer alone holds them.
        held = [*sorted((min(p.pull_depth, n) for p in others.values()), reverse=True), 0, 0]
        # The peer computing the most of this prompt, the soonest done on ties.
        peer = max(
            others,
            key=lambda name: (min(others[name].pending, n), -others[name].pending_wait_tokens),
            default=None,
        )
        computing = min(others[peer].pending, n) if peer is not None else 0
        options = []
        # Its own tiers: blocks past ``local`` in host memory, then on disk.
        in_host = max(min(v.host_depth, n), local)
        own = max(min(v.disk_depth, n), in_host)
        c = self.cost_of(w)
        load_s = (in_host - local) * c.t_host_block_s + (own - in_host) * c.t_disk_block_s
        holder = self.pick_holder(
            w, {name: min(p.pull_depth, n) for name, p in others.items()}, nodes
        )
        reach = max(local, held[0]) if self.connector else local
        duplicate = max(computing - max(reach, own), 0) if self.connector else 0
        # A single peer's blocks that this worker has in none of its media (its tiers hold
        # a conversation's history as much as its pool does).
        moved = max(reach - max(own, held[1]), 0)
        # Blocks this worker is still to receive count as local, but the request bringing
        # them may reach the worker after this one (another ingress routed it): this one
        # then waits for the same source and pulls or hits, instead of computing them.
        source = None
        if self.connector and local > min(v.depth, n):
            deepest = max(others, key=lambda name: (min(others[name].depth, n), name), default=None)
            if deepest is not None and min(others[deepest].depth, n) >= local:
                source = deepest
            elif computing >= local:
                source = peer
        if reach > own or source is not None:  # it pulls what a peer holds beyond its tiers
            extra = duplicate + moved
            promote_s = self._promote_s(others, holder, local, reach, n)
            pull_s = c.t_pull_block_from(holder)
            options.append(
                self._option(c, v, n, partial, local, reach, extra, 0.0, source, promote_s, pull_s)
            )
        # Or its own tiers and compute the rest (what peers hold too: faster than pulling
        # over a slow link).
        own_opt = self._option(c, v, n, partial, own, own, duplicate + moved, 0.0, None, load_s)
        options.append(dataclasses.replace(own_opt, local=local))
        if self.connector and computing > max(reach, own):
            assert peer is not None
            wait = others[peer].pending_wait_tokens * self.cost_of(peer).t_token_s
            link = c.t_pull_block_from(peer)
            options.append(
                self._option(c, v, n, partial, local, computing, moved, wait, peer, 0.0, link)
            )
        return options

    def _promote_s(
        self, others: Mapping[str, WorkerView], holder: str | None, local: int, reach: int, n: int
    ) -> float:
        """What ``holder`` (the plan's) spends promoting the pulled blocks it keeps in its
        tiers, not its pool, before the read: the same copy as a load from those tiers, at
        the costs it measured."""
        if reach <= local or holder is None:
            return 0.0
        p, c = others[holder], self.cost_of(holder)
        in_pool = max(min(p.depth, n), local)
        in_host = min(max(min(p.host_depth, n), in_pool), reach)
        disk = max(reach - in_host, 0)
        return (in_host - in_pool) * c.t_host_block_s + disk * c.t_disk_block_s

    def _option(
        self,
        c: CostModel,
        v: WorkerView,
        n: int,
        partial: int,
        local: int,
        reach: int,
        extra: int,
        wait_s: float,
        wait_for: str | None,
        load_s: float = 0.0,
        pull_block_s: float | None = None,
    ) -> _Option:
        """Blocks up to ``local`` are the worker's own, up to ``reach`` pulled (at
        ``pull_block_s`` a block: its link's, default its mean), the rest computed, at the
        worker's costs ``c``; ``load_s``: copying blocks out of a host or disk tier (its own
        tiers' loads, or the holder's promotions for a pull)."""
        bs = self.block_size
        pull = reach - local
        compute_tokens = (n - reach) * bs + partial
        ttft = (
            max(wait_s, v.backlog_tokens * c.t_token_s)
            + compute_tokens * c.t_token_s
            + pull * (c.t_pull_block_s if pull_block_s is None else pull_block_s)
            + load_s
            + v.queue * c.t_queue_s
        )
        return _Option(ttft + extra * bs * c.t_token_s, ttft, local, pull, compute_tokens, wait_for)
