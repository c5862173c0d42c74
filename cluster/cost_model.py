"""What a worker measures of its own costs, for the router (docs/router.md, "Measured, not
constant").

``CostModel``: ``t_token`` (compute time per prompt token), ``t_pull_block`` (time per pulled
block, and per peer's link: ``pull_links``), ``t_host_block`` / ``t_disk_block`` (time per
block loaded from a tier) and ``t_queue`` (time a queued request adds): exponential moving
averages of what finished requests report, measured while running, never constants (they
start from rough priors). Each worker replica keeps one and reports it with its routing
stats; ``worker_costs`` turns the reports into each worker's costs, a missing one the
others' mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvmesh.workers.outputs import RequestMetrics

PRIOR_T_TOKEN_S = 2e-3
PRIOR_T_PULL_BLOCK_S = 2e-4
PRIOR_T_QUEUE_S = 0.05
PRIOR_T_HOST_BLOCK_S = 1e-4
PRIOR_T_DISK_BLOCK_S = 1e-3
EMA = 0.2
# (CostModel attribute, its key in CostModel.samples): every measured cost.
COSTS = (
    ("t_token_s", "token"),
    ("t_pull_block_s", "pull"),
    ("t_queue_s", "queue"),
    ("t_host_block_s", "host"),
    ("t_disk_block_s", "disk"),
)
SAMPLES = tuple(sample for _, sample in COSTS)
# A prefill this short measures a step's fixed cost (a batch's decodes, the sampler), not its
# tokens: 14 tokens in a 7 ms step would teach 0.5 ms a token where 2,000 take 30 us each.
MIN_LEARN_TOKENS = 64
MAX_LINKS = 256  # peers whose link costs a worker keeps


@dataclass
class CostModel:
    t_token_s: float = PRIOR_T_TOKEN_S
    t_pull_block_s: float = PRIOR_T_PULL_BLOCK_S
    t_queue_s: float = PRIOR_T_QUEUE_S
    t_host_block_s: float = PRIOR_T_HOST_BLOCK_S
    t_disk_block_s: float = PRIOR_T_DISK_BLOCK_S
    samples: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SAMPLES, 0))
    # t_pull_block over the link from each peer (learned from requests whose reads all came
    # from that peer; a peer on this host is not one across a network), the most recently
    # used MAX_LINKS; a peer not here costs t_pull_block_s.
    pull_links: dict[str, float] = field(default_factory=dict)
    link_samples: dict[str, int] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        """What a worker reports with its routing stats, as ``worker_costs`` reads it: the
        costs, their sample counts and the link costs."""
        return {
            **{key: getattr(self, key) for key, _ in COSTS},
            "samples": dict(self.samples),
            "pull_links": dict(self.pull_links),
        }

    def t_pull_block_from(self, holder: str | None) -> float:
        """Seconds a block pulled from ``holder`` costs (its link's, when measured)."""
        return self.pull_links.get(holder, self.t_pull_block_s) if holder else self.t_pull_block_s

    def observe(
        self,
        ttft_s: float,
        computed_tokens: int,
        pulled_blocks: int,
        queue_len: int,
        pull_s: float | None = None,
        backlog_tokens: int = 0,
        read_blocks: int | None = None,
        block_size: int = 0,
        queue_s: float | None = None,
        tier: tuple[int, int, float] | None = None,
        read_from: str | None = None,
    ) -> None:
        """Fold one finished request's TTFT (as its worker measured it) into the estimates.
        ``queue_len`` / ``backlog_tokens``: what was ahead of it on its worker when routed.
        ``pull_s``: its time in reads of ``read_blocks`` blocks (default ``pulled_blocks``).
        Reads that failed count too, at what trying cost: their time plus computing the
        blocks they did not bring (``block_size`` tokens each). A link too slow for the
        read's timeout then teaches the router to compute, not to keep pulling in vain.
        ``queue_s``: how long it waited to be scheduled, when the worker measured it: that
        wait is the queue's, never the prompt's (a request that computed 10 tokens after
        waiting 0.4 s for a free sequence slot must not teach 40 ms per token).
        ``tier``: (host blocks, disk blocks, seconds) of a load from the worker's own tiers.
        ``read_from``: the peer every read was from, whose link's cost they teach too.
        """
        queue_part = queue_len * self.t_queue_s if queue_s is None else queue_s
        tier_part = 0.0
        if tier is not None and tier[0] + tier[1] > 0:
            self.observe_tier_load(*tier)
            tier_part = tier[2]
        read_blocks = pulled_blocks if read_blocks is None else read_blocks
        if read_blocks and pull_s is not None:
            failed_tokens = max(read_blocks - pulled_blocks, 0) * block_size
            per_block = (pull_s + failed_tokens * self.t_token_s) / read_blocks
            self.t_pull_block_s = _ema(self.t_pull_block_s, per_block, self.samples["pull"])
            self.samples["pull"] += 1
            if read_from is not None:
                self._observe_link(read_from, per_block)
        pull_part = pulled_blocks * self.t_pull_block_s if pull_s is None else pull_s
        if computed_tokens >= MIN_LEARN_TOKENS:
            tokens = computed_tokens + backlog_tokens
            per_token = max(ttft_s - pull_part - tier_part - queue_part, 0.0) / tokens
            self.t_token_s = _ema(self.t_token_s, per_token, self.samples["token"])
            self.samples["token"] += 1
        if queue_len:
            if queue_s is None:
                own = (computed_tokens + backlog_tokens) * self.t_token_s + pull_part + tier_part
                queue_s = max(ttft_s - own, 0.0)
            self.t_queue_s = _ema(self.t_queue_s, queue_s / queue_len, self.samples["queue"])
            self.samples["queue"] += 1

    def _observe_link(self, holder: str, per_block: float) -> None:
        seen = self.link_samples.pop(holder, 0)
        old = self.pull_links.pop(holder, per_block)
        self.pull_links[holder] = _ema(old, per_block, seen)  # re-added: the most recent last
        self.link_samples[holder] = seen + 1
        while len(self.pull_links) > MAX_LINKS:  # peers come and go: forget the oldest
            oldest = next(iter(self.pull_links))
            del self.pull_links[oldest], self.link_samples[oldest]

    def observe_request(self, m: RequestMetrics, queue_len: int, block_size: int) -> None:
        """``observe`` for a finished request as its worker measured it (``m``): the pull
        time is that of its own reads (a read that failed counts; a request that hit the
        blocks another request here pulled read nothing and teaches nothing about pulls)."""
        if m.ttft_s is None:
            return
        self.observe(
            m.ttft_s,
            m.num_computed_tokens,
            m.num_pulled_tokens // block_size,
            queue_len,
            pull_s=m.read_s if m.num_read_blocks else None,
            read_blocks=m.num_read_blocks or None,
            block_size=block_size,
            queue_s=None
            if m.first_scheduled_time is None
            else m.first_scheduled_time - m.arrival_time,
            tier=_tier_load(m, block_size),
            read_from=m.read_from,
        )

    def observe_tier(self, medium: str, blocks: int, seconds: float) -> None:
        """``blocks`` copied from this worker's ``medium`` tier ("host" or "disk") into its
        pool in ``seconds``: a load, or a promotion a peer's pin asked for (the same copy)."""
        if blocks <= 0:
            return
        key = f"t_{medium}_block_s"
        setattr(self, key, _ema(getattr(self, key), seconds / blocks, self.samples[medium]))
        self.samples[medium] += 1

    def observe_tier_load(self, host_blocks: int, disk_blocks: int, seconds: float) -> None:
        """A load of ``host_blocks`` from this worker's host tier and ``disk_blocks`` from its
        disk in ``seconds`` (one figure for both). A mixed load teaches only the disk: its
        time less what the host blocks cost (as learned), and never less than an even split
        gives it, as a disk block is no faster than a host one. Before, the whole time was
        spread over every block, so a few disk blocks behind many host ones taught the
        router a disk nearly as fast as memory."""
        if not disk_blocks:
            self.observe_tier("host", host_blocks, seconds)
            return
        even_host_share = seconds * host_blocks / (host_blocks + disk_blocks)
        host_part = min(host_blocks * self.t_host_block_s, even_host_share)
        self.observe_tier("disk", disk_blocks, seconds - host_part)


def _tier_load(m: RequestMetrics, block_size: int) -> tuple[int, int, float] | None:
    """(host blocks, disk blocks, seconds) of a request's load from its worker's own tiers,
    if any."""
    host, disk = m.num_host_hit_tokens // block_size, m.num_disk_hit_tokens // block_size
    return (host, disk, m.kv_load_s) if host + disk else None


def _sampled(report: Mapping[str, Any], key: str, sample: str) -> bool:
    """Whether a worker's report carries a measured value of cost ``key`` (samples key
    ``sample``); a report without it (another version's replica) counts as none."""
    return isinstance(report.get(key), int | float) and bool(report.get("samples", {}).get(sample))


def _ema(old: float, new: float, seen: int) -> float:
    """The moving average after ``seen`` earlier samples: their plain mean until there are
    1 / EMA of them (the prior is dropped at the first), then exponential."""
    weight = max(EMA, 1 / (seen + 1))
    return (1 - weight) * old + weight * new


def worker_costs(reports: Mapping[str, Mapping[str, Any]], mean: CostModel) -> dict[str, CostModel]:
    """Each worker's costs from its report (its routing stats: the costs, ``samples``, how
    many samples each rests on, and ``pull_links``). First sets each cost of ``mean`` to the
    mean over the workers that have a sample of it (kept as it was when none has: the prior);
    a cost a worker has no sample of is then that mean."""
    for key, sample in COSTS:
        seen = [r[key] for r in reports.values() if _sampled(r, key, sample)]
        if seen:
            setattr(mean, key, sum(seen) / len(seen))
    return {
        w: CostModel(
            **{key: r[key] if _sampled(r, key, s) else getattr(mean, key) for key, s in COSTS},
            samples={s: int(r.get("samples", {}).get(s, 0)) for s in SAMPLES},
            pull_links=dict(r.get("pull_links", {})),
        )
        for w, r in reports.items()
    }
