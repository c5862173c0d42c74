"""``ServeMetrics``: the Prometheus metrics of the OpenAI front end, on a registry of its own.

Two kinds of numbers meet here. Events the front end sees itself (requests, TTFT, token gaps,
generated and prompt tokens) are counted as they happen. Cluster state (per-worker queues,
index size, pull counters) belongs to the backend: it is read from ``await backend.stats()``
on each scrape and exported by a collector, so a worker that is gone also leaves /metrics
instead of lingering as a stale label set.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvmesh.cluster.backend import Completion

CONTENT_TYPE = CONTENT_TYPE_LATEST
# TTFT spans a few ms (cache hit, small model) to seconds (long prompt, busy GPU).
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
PROMPT_SOURCES = ("local_hit", "host_hit", "disk_hit", "pulled", "computed")
# The local tiers' counters in a connector's stats (workers/kv_tiers.py, tiered_connector.py):
# summed over workers into the backend's stats, exported below.
TIER_STATS = (
    "demoted_blocks",
    "host_blocks",
    "host_bytes",
    "disk_blocks",
    "disk_bytes",
    "host_loaded_blocks",
    "disk_loaded_blocks",
    "disk_corrupt_blocks",
    "disk_missing_blocks",
    "disk_write_errors",
    "disk_writes_dropped",
    "disk_evicted_blocks",
    "promoted_blocks",
)
# (metric name, stats key, help) of the tiers' plain counters.
_TIER_COUNTERS = (
    ("tier_demoted_blocks", "demoted_blocks", "Blocks copied out before the pool reused them"),
    ("disk_corrupt_blocks", "disk_corrupt_blocks", "Disk tier blocks found torn or corrupt"),
    (
        "disk_missing_blocks",
        "disk_missing_blocks",
        "Disk tier blocks whose file was gone when read (deleted outside kvmesh)",
    ),
    ("disk_write_errors", "disk_write_errors", "Disk tier writes that failed (e.g. disk full)"),
    (
        "disk_writes_dropped",
        "disk_writes_dropped",
        "Disk tier writes dropped: the write queue was full (a disk slower than evictions)",
    ),
    ("disk_evicted_blocks", "disk_evicted_blocks", "Disk tier blocks deleted to keep its size"),
    (
        "tier_promoted_blocks",
        "promoted_blocks",
        "Tier blocks copied back into the pool for a peer's pin",
    ),
)
_WORKER_GAUGES = {
    "running": "Requests running per worker",
    "waiting": "Requests waiting per worker",
    "free_blocks": "Free KV blocks per worker",
}


class ServeMetrics:
    """Counters and histograms of one API app; ``render()`` is the /metrics body.

    Each instance owns a ``CollectorRegistry``, so several apps (or tests) in one process
    never collide on metric names.
    """

    def __init__(self, namespace: str = "kvmesh") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ns, reg = namespace, self.registry
        self.requests = Counter(
            "requests",
            "HTTP requests by route and status",
            ["route", "status"],
            namespace=ns,
            registry=reg,
        )
        self.ttft = Histogram(
            "time_to_first_token_seconds",
            "Time to first token at the ingress: from the request's arrival to its first "
            "token (a stream's first chunk; a whole response's end less the worker's decode)",
            namespace=ns,
            registry=reg,
            buckets=_TTFT_BUCKETS,
        )
        self.inter_token = Histogram(
            "inter_token_latency_seconds",
            "Time between streamed tokens",
            namespace=ns,
            registry=reg,
            buckets=_ITL_BUCKETS,
        )
        self.generated_tokens = Counter(
            "generated_tokens", "Tokens generated", namespace=ns, registry=reg
        )
        self.prompt_tokens = Counter(
            "prompt_tokens",
            "Prompt tokens by where their KV came from",
            ["source"],
            namespace=ns,
            registry=reg,
        )
        for source in PROMPT_SOURCES:  # export zeros before the first request
            self.prompt_tokens.labels(source)
        self._stats = _StatsCollector(ns)
        reg.register(self._stats)

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def observe_completion(self, completion: Completion, ttft_s: float | None) -> None:
        """Count a finished request's tokens and its TTFT at the ingress (``ttft_s``; the
        response's ``kvmesh.ttft_ms`` is the worker's own, from the request's arrival there:
        it leaves out waiting for a worker replica, or a prefill on another worker)."""
        kv = completion.kv
        self.generated_tokens.inc(len(completion.token_ids))
        self.prompt_tokens.labels("local_hit").inc(kv.local_hit_tokens)
        self.prompt_tokens.labels("host_hit").inc(kv.host_hit_tokens)
        self.prompt_tokens.labels("disk_hit").inc(kv.disk_hit_tokens)
        self.prompt_tokens.labels("pulled").inc(kv.pulled_tokens)
        self.prompt_tokens.labels("computed").inc(kv.computed_tokens)
        if ttft_s is not None:
            self.ttft.observe(max(0.0, ttft_s))

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """A streamed chunk of ``num_tokens`` tokens arrived ``seconds`` after the last one."""
        if num_tokens > 0:
            per_token = seconds / num_tokens
            for _ in range(num_tokens):
                self.inter_token.observe(per_token)

    def set_stats(self, stats: Mapping[str, Any] | None) -> None:
        """The backend's latest ``stats()``; missing keys export nothing."""
        self._stats.stats = dict(stats or {})

    def render(self) -> bytes:
        """The Prometheus text exposition of everything above."""
        return generate_latest(self.registry)


class _StatsCollector(Collector):
    """Exports the last ``backend.stats()`` snapshot as gauges and counters."""

    def __init__(self, namespace: str) -> None:
        self.ns = namespace
        self.stats: dict[str, Any] = {}

    def describe(self) -> Iterator[Metric]:
        return iter(())  # names vary with the snapshot; nothing to reserve up front

    def collect(self) -> Iterator[Metric]:
        ns, s = self.ns, self.stats
        workers = s.get("workers")
        if isinstance(workers, Mapping):
            for key, help_text in _WORKER_GAUGES.items():
                g = GaugeMetricFamily(f"{ns}_worker_{key}", help_text, labels=["worker"])
                for name, load in sorted(workers.items()):
                    if isinstance(load, Mapping) and _is_number(load.get(key)):
                        g.add_metric([str(name)], load[key])
                yield g
        if _is_number(s.get("index_blocks")):
            yield GaugeMetricFamily(
                f"{ns}_index_blocks", "Blocks in the cluster KV index", value=s["index_blocks"]
            )
        # Cumulative in the workers, so counters here (Prometheus appends _total).
        if _is_number(s.get("pull_bytes")):
            yield CounterMetricFamily(
                f"{ns}_pull_bytes", "KV bytes pulled from peers", value=s["pull_bytes"]
            )
        if _is_number(s.get("pull_failures")):
            yield CounterMetricFamily(
                f"{ns}_pull_failures", "Failed pulls from peers", value=s["pull_failures"]
            )
        yield from self._tiers()

    def _tiers(self) -> Iterator[Metric]:
        ns, s = self.ns, self.stats
        if not all(_is_number(s.get(k)) for k in TIER_STATS):
            return
        media = ("host", "disk")
        held = GaugeMetricFamily(f"{ns}_tier_blocks", "Blocks in the tiers", labels=["medium"])
        size = GaugeMetricFamily(f"{ns}_tier_bytes", "Bytes in the tiers", labels=["medium"])
        loaded = CounterMetricFamily(
            f"{ns}_tier_loaded_blocks", "Blocks loaded back from a tier", labels=["medium"]
        )
        for m in media:
            held.add_metric([m], s[f"{m}_blocks"])
            size.add_metric([m], s[f"{m}_bytes"])
            loaded.add_metric([m], s[f"{m}_loaded_blocks"])
        yield from (held, size, loaded)
        for name, key, what in _TIER_COUNTERS:
            yield CounterMetricFamily(f"{ns}_{name}", what, value=s[key])


def tier_totals(connector_stats: list[Mapping[str, Any]]) -> dict[str, float]:
    """The tiers' counters summed over workers; empty when no worker has tiers."""
    with_tiers = [c for c in connector_stats if "host_blocks" in c]
    if not with_tiers:
        return {}
    return {k: sum(c.get(k, 0) for c in with_tiers) for k in TIER_STATS}


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)
