"""The serving configuration: one frozen object from a YAML file and/or command-line flags.

Everything is checked here, before any process starts: unknown keys, wrong types, and
settings that contradict each other are refused with a message that names them.
"""

from __future__ import annotations

import dataclasses
import io
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from kvmesh.workers.memory_size import memory_setting
from kvmesh.workers.tier_config import check_disk_cache_size

ROUTERS = ("kv_aware", "round_robin", "least_loaded")
TRANSPORTS = ("nixl", "ray")
DTYPES = ("float32", "bfloat16", "float16")
# The API key from the environment when no setting names one, as VLLM_API_KEY is for vLLM:
# a key kept out of command lines (`ps`), shell history and manifests (a Kubernetes Secret).
API_KEY_ENV = "KVMESH_API_KEY"


@dataclass(frozen=True)
class ServeConfig:
    model: str = "smollm2-135m"
    served_model_name: str | None = None  # the name clients send; default: model
    block_size: int = 16
    kv_cache_memory: str = "1GiB"  # per worker
    # Tiers for blocks a worker's pool evicts (workers/kv_tiers.py), per worker: host memory,
    # then local disk (a directory on each host; workers on one host take slots of their own).
    host_cache_memory: str = "0"
    disk_cache_dir: str | None = None
    disk_cache_size: str | None = None  # with disk_cache_dir; None: 4GiB
    workers: int | None = None  # unified workers; default 1 when no P/D roles are given
    prefill_workers: int = 0
    decode_workers: int = 0
    router: str = "kv_aware"
    transport: str | None = None  # None: NIXL when importable, else the Ray object store
    connector: bool = True  # False: local prefix caching only (the baseline)
    host: str = "127.0.0.1"
    port: int = 8000
    # repr=False: a config in a log line or an error message never shows the key.
    api_key: str | None = field(default=None, repr=False)
    # HTTPS in Serve's HTTP proxies (vLLM's --ssl-keyfile / --ssl-certfile): PEM files at
    # these paths on every node that runs a proxy. `kvmesh serve` and ``deploy`` start Serve
    # with them; a RayService sets them in its serveConfigV2's http_options instead.
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    max_request_bytes: int = 2 * 1024 * 1024  # larger HTTP bodies get a 413
    # Admission, per ingress replica: it holds at most its share of what the workers run at
    # once (max_num_seqs each, at the most workers) plus this many sequences waiting, and
    # answers the rest 429 with Retry-After at once (``admission_limit``). The default, one
    # worker batch, lets a waiting request start within about one batch's time: admitted
    # latency stays bounded while a burst still queues instead of being refused.
    max_queued_requests: int = 64
    retry_after_s: float = 1.0  # the Retry-After of a refusal (rounded up to whole seconds)
    num_cpus_per_worker: float = 1.0
    num_gpus_per_worker: float | None = None  # None: 1 when the cluster has GPUs, else 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    # The context (prompt + answer) a request may use; None: the model's. Longer prompts get
    # a 400 at the ingress. A smaller one bounds what one request can cost a worker.
    max_model_len: int | None = None
    device: str | None = None
    dtype: str | None = None
    # The KV cache's element type: auto (the model's dtype), float32, bfloat16 or float16
    # (a 16-bit cache under a float32 model: twice the tokens per GiB, half the bytes moved).
    kv_cache_dtype: str = "auto"
    # Autoscaling: with max_* set, the worker count above is the minimum and Serve scales
    # the deployment between the two on ongoing requests per replica.
    max_workers: int | None = None
    max_prefill_workers: int | None = None
    max_decode_workers: int | None = None
    target_ongoing_requests: float = 4.0
    downscale_delay_s: float = 30.0  # load must stay low this long before a worker stops
    ingress_replicas: int = 1
    max_migrations: int = 3  # times one request may move to another worker after a failure
    # Under P/D, how long a prompt waits for a prefill replica to take it (all busy, or none
    # up while Serve replaces a lost one) before its decode worker computes it instead.
    prefill_wait_s: float = 2.0
    health_check_period_s: float = 2.0
    # A worker whose step thread made no progress for this long while it had work is
    # unhealthy (Serve replaces it).
    health_stall_s: float = 30.0
    # How long a stopping worker, or a stopping app's ingress, lets running requests finish
    # (the app's then end with a 503).
    drain_timeout_s: float = 30.0
    # A stream sends at most one message per interval: the tokens made in between go
    # together (the first at once). Each hop (engine actor, worker, ingress, HTTP) costs per
    # message; 0: no interval (what piled up while a consumer was busy still goes as one).
    stream_interval_s: float = 0.05
    # Ray custom resources each worker / ingress replica needs, e.g. {"gpu_node": 1}: where
    # an operator wants them placed (the ingress on CPU-only nodes, one worker per host).
    worker_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    ingress_resources: dict[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        for f in fields(self):
            value = getattr(self, f.name)
            want = _TYPES[f.name]
            if value is not None and not _is(value, want):
                raise bad(f.name, f"must be {want.__name__}")
        if self.workers is not None and (self.prefill_workers or self.decode_workers):
            raise ValueError(
                "workers: give either workers (unified) or prefill_workers + decode_workers, "
                "not both"
            )
        if bool(self.prefill_workers) != bool(self.decode_workers):
            raise ValueError(
                "prefill_workers/decode_workers: prefill/decode disaggregation needs at least "
                f"one of each, got {self.prefill_workers} prefill and {self.decode_workers} decode"
            )
        if self.workers is not None and self.workers < 1:
            raise bad("workers", "must be >= 1")
        if self.prefill_workers < 0 or self.decode_workers < 0:
            raise ValueError("prefill_workers/decode_workers: must be >= 0")
        if self.disaggregated and not self.connector:
            raise ValueError(
                "connector: prefill/decode disaggregation moves KV through the connector; "
                "it cannot run with --no-connector"
            )
        if self.router not in ROUTERS:
            raise bad("router", f"must be one of {', '.join(ROUTERS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise bad("dtype", f"must be one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in ("auto", *DTYPES):
            raise bad("kv_cache_dtype", f"must be one of auto, {', '.join(DTYPES)}")
        if self.transport is not None and self.transport not in TRANSPORTS:
            raise bad("transport", f"must be one of {', '.join(TRANSPORTS)}")
        if not 0 <= self.port <= 65535:
            raise bad("port", "must be in [0, 65535]")
        if self.block_size < 1:
            raise bad("block_size", "must be >= 1")
        for role, count, most in self._scaling():
            if most is not None and most < count:
                raise ValueError(f"max_{role}: must be >= the {role} count ({count}), got {most}")
        if self.max_workers is not None and self.disaggregated:
            raise ValueError("max_workers: use max_prefill_workers / max_decode_workers with P/D")
        if (self.max_prefill_workers or self.max_decode_workers) and not self.disaggregated:
            raise ValueError(
                "max_prefill_workers/max_decode_workers: need prefill_workers + decode_workers"
            )
        for name in ("ingress_replicas",):
            if getattr(self, name) < 1:
                raise bad(name, "must be >= 1")
        if self.max_migrations < 0:
            raise bad("max_migrations", "must be >= 0")
        for name in (
            "target_ongoing_requests",
            "downscale_delay_s",
            "health_check_period_s",
            "health_stall_s",
            "drain_timeout_s",
            "retry_after_s",
            "prefill_wait_s",
        ):
            if not 0 < getattr(self, name) < float("inf"):
                raise bad(name, "must be a positive finite number")
        if not 0 <= self.stream_interval_s <= 1:
            raise bad("stream_interval_s", "must be a number of seconds in [0, 1]")
        if self.max_request_bytes < 1:
            raise bad("max_request_bytes", "must be >= 1")
        if self.max_num_seqs < 1:
            raise bad("max_num_seqs", "must be >= 1")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise bad("max_model_len", "must be >= 2 (a prompt token and an answer token)")
        if self.max_queued_requests < 0:
            raise bad("max_queued_requests", "must be >= 0")
        for name in ("worker_resources", "ingress_resources"):
            for key, amount in getattr(self, name).items():
                if not isinstance(key, str) or not _is(amount, float) or not 0 < amount < 1e9:
                    raise bad(name, "must map resource names to positive amounts")
        check_disk_cache_size(self.disk_cache_size, self.disk_cache_dir)
        for name in ("kv_cache_memory", "host_cache_memory", "disk_cache_size"):
            if getattr(self, name) is None:  # disk_cache_size: the default
                continue
            memory_setting(name, getattr(self, name))
        if self.disk_cache_dir == "":
            raise bad("disk_cache_dir", "must be a directory (leave it out for no disk tier)")
        if self.api_key == "":
            raise bad("api_key", "must not be empty (leave it out to disable auth)")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile: give both for HTTPS, or neither")
        for name in ("ssl_keyfile", "ssl_certfile"):
            if getattr(self, name) == "":
                raise bad(name, "must be a file (leave it out for plain HTTP)")

    @property
    def http_options(self) -> dict[str, Any]:
        """Serve's HTTP options for this config: the address, and TLS when set."""
        tls = {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile}
        return {"host": self.host, "port": self.port, **(tls if self.ssl_certfile else {})}

    @property
    def base_url(self) -> str:
        """Where clients reach the OpenAI API."""
        scheme = "https" if self.ssl_certfile else "http"
        return f"{scheme}://{self.host}:{self.port}/v1"

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill_workers)

    @property
    def num_unified_workers(self) -> int:
        return 0 if self.disaggregated else (self.workers or 1)

    def _scaling(self) -> list[tuple[str, int, int | None]]:
        """(role, count, max count or None) per worker deployment."""
        if self.disaggregated:
            return [
                ("prefill_workers", self.prefill_workers, self.max_prefill_workers),
                ("decode_workers", self.decode_workers, self.max_decode_workers),
            ]
        return [("workers", self.num_unified_workers, self.max_workers)]

    @property
    def roles(self) -> list[tuple[str, int, int | None]]:
        """(deployment role, min replicas, max replicas or None for a fixed count)."""
        names = ("prefill", "decode") if self.disaggregated else ("worker",)
        return [(n, c, m) for n, (_, c, m) in zip(names, self._scaling(), strict=True)]

    @property
    def worker_max_ongoing_requests(self) -> int:
        """Requests one worker replica takes at once (Serve's ``max_ongoing_requests``): its
        batch and three more batches waiting in its scheduler."""
        return self.max_num_seqs * 4

    @property
    def worker_capacity(self) -> int:
        """Requests the workers that hold them (unified or decode) run at once, at their most
        replicas: ``max_num_seqs`` each. A prefill holds its request for one token only."""
        most = sum(m if m is not None else c for role, c, m in self.roles if role != "prefill")
        return most * self.max_num_seqs

    @property
    def admission_limit(self) -> int:
        """Sequences (one per choice of a request) one ingress replica admits at once, running
        and waiting: its share of ``worker_capacity`` plus ``max_queued_requests``."""
        share = -(-self.worker_capacity // self.ingress_replicas)  # rounded up
        return share + self.max_queued_requests

    @property
    def cluster_admission_limit(self) -> int:
        """Sequences all ingress replicas admit at once together."""
        return self.admission_limit * self.ingress_replicas

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ServeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(
                f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**d)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ServeConfig:
        return cls.from_dict(load_yaml(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML keeps the last of two equal keys silently; a settings file that names one
    twice is a mistake to report, not to guess."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"{key!r} is set twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


def with_env_api_key(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with ``api_key`` from ``KVMESH_API_KEY`` when they set none (a flag or a
    file still wins). Raises ValueError when the variable is set but blank, rather than
    serve without the key it was meant to hold."""
    key = os.environ.get(API_KEY_ENV)
    if key is None or settings.get("api_key") is not None:
        return settings
    if not key.strip():
        raise ValueError(f"{API_KEY_ENV} is set but empty (unset it to serve without a key)")
    return {**settings, "api_key": key}


def load_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_bytes().decode("utf-8")  # whole: a decode error's offset is exact
        # A named stream, not the text: YAML's error marks name the file, not "<unicode string>".
        stream = io.StringIO(text)
        stream.name = str(path)
        data = yaml.load(stream, Loader=_UniqueKeyLoader)  # a SafeLoader
    except OSError as e:
        raise ValueError(f"config: cannot read {path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ValueError(f"config: {path} is not UTF-8 text (byte {e.start}: {e.reason})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"config: {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config: {path} must hold a mapping of settings")
    settings: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name in settings:  # e.g. max-workers and max_workers
            raise ValueError(f"config: {path} sets {name} twice")
        settings[name] = value
    return settings


_TYPES: dict[str, type] = {
    "model": str,
    "served_model_name": str,
    "block_size": int,
    "kv_cache_memory": str,
    "host_cache_memory": str,
    "disk_cache_dir": str,
    "disk_cache_size": str,
    "workers": int,
    "prefill_workers": int,
    "decode_workers": int,
    "router": str,
    "transport": str,
    "connector": bool,
    "host": str,
    "port": int,
    "api_key": str,
    "ssl_keyfile": str,
    "ssl_certfile": str,
    "max_request_bytes": int,
    "max_queued_requests": int,
    "retry_after_s": float,
    "num_cpus_per_worker": float,
    "num_gpus_per_worker": float,
    "max_num_seqs": int,
    "max_num_batched_tokens": int,
    "max_model_len": int,
    "device": str,
    "dtype": str,
    "kv_cache_dtype": str,
    "max_workers": int,
    "max_prefill_workers": int,
    "max_decode_workers": int,
    "target_ongoing_requests": float,
    "downscale_delay_s": float,
    "ingress_replicas": int,
    "max_migrations": int,
    "prefill_wait_s": float,
    "health_check_period_s": float,
    "health_stall_s": float,
    "drain_timeout_s": float,
    "stream_interval_s": float,
    "worker_resources": dict,
    "ingress_resources": dict,
}


def _is(value: Any, want: type) -> bool:
    if want is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if want is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, want)
