"""`kvmesh serve`'s flags: one per ServeConfig field it exposes (dashes for underscores), plus
``--config`` (a YAML file the flags override), ``--no-connector``, ``--address`` and
``--replace``; ``config_from_args`` turns them into a ``ServeConfig``."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from kvmesh.cluster.config import DTYPES, ServeConfig, load_yaml, with_env_api_key
from kvmesh.workers.tokenizer_loader import KNOWN_MODELS

# Flags that map 1:1 onto ServeConfig fields (the CLI spelling uses dashes).
_FLAGS: dict[str, dict[str, Any]] = {
    "model": {"help": "a known name, a .gguf file or an HF directory"},
    "served-model-name": {"help": "the model name clients send (default: --model)"},
    "block-size": {"type": int},
    "kv-cache-memory": {"help": "KV cache per worker, e.g. 1GiB"},
    "host-cache-memory": {"help": "per worker, host memory for blocks the pool evicts, e.g. 4GiB"},
    "disk-cache-dir": {"help": "a local directory for blocks the host tier evicts (kept)"},
    "disk-cache-size": {"help": "per worker, the disk tier's size (default 4GiB)"},
    "workers": {"type": int, "help": "unified workers"},
    "prefill-workers": {"type": int},
    "decode-workers": {"type": int},
    "router": {"choices": ["kv_aware", "round_robin", "least_loaded"]},
    "transport": {"choices": ["nixl", "ray"]},
    "host": {},
    "port": {"type": int},
    "api-key": {
        "help": "require this bearer key on /v1/* and /metrics (or set KVMESH_API_KEY, "
        "which keeps it out of ps)"
    },
    "ssl-keyfile": {"help": "HTTPS: the server's private key (PEM), with --ssl-certfile"},
    "ssl-certfile": {"help": "HTTPS: the server's certificate chain (PEM)"},
    "max-request-bytes": {"type": int, "help": "larger HTTP bodies get a 413"},
    "max-queued-requests": {
        "type": int,
        "help": "per ingress replica, sequences (one per choice) admitted beyond what the "
        "workers run at once; "
        "the rest get a 429 with Retry-After (default 64)",
    },
    "retry-after-s": {"type": float, "help": "the Retry-After of a 429 (default 1)"},
    "num-cpus-per-worker": {"type": float},
    "num-gpus-per-worker": {"type": float},
    "max-num-seqs": {"type": int},
    "max-num-batched-tokens": {"type": int},
    "max-model-len": {"type": int, "help": "context per request (default: the model's)"},
    "device": {},
    "dtype": {"choices": list(DTYPES)},
    "kv-cache-dtype": {
        "choices": ["auto", *DTYPES],
        "help": "the KV cache's element type (default auto: the model's dtype)",
    },
    "max-workers": {"type": int, "help": "autoscale unified workers up to this many"},
    "max-prefill-workers": {"type": int},
    "max-decode-workers": {"type": int},
    "target-ongoing-requests": {"type": float, "help": "per worker, for autoscaling"},
    "downscale-delay-s": {"type": float},
    "ingress-replicas": {"type": int},
    "max-migrations": {"type": int, "help": "moves of one request after worker losses"},
    "prefill-wait-s": {
        "type": float,
        "help": "P/D: seconds a prompt waits for a prefill replica before decode computes it",
    },
    "health-check-period-s": {"type": float},
    "health-stall-s": {"type": float},
    "drain-timeout-s": {"type": float},
    "stream-interval-s": {
        "type": float,
        "help": "a stream sends at most one chunk per interval, the tokens made in between "
        "together (default 0.05; 0: no interval)",
    },
    "worker-resources": {
        "type": lambda s: _json_object(s, "worker-resources"),
        "help": "Ray custom resources per worker, JSON, e.g. '{\"gpu_host\": 1}'",
    },
    "ingress-resources": {
        "type": lambda s: _json_object(s, "ingress-resources"),
        "help": "Ray custom resources per ingress replica, JSON",
    },
}


def _json_object(text: str, flag: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{flag}: must be a JSON object, got {text!r}")
    return value


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a YAML file of settings; flags override it")
    for flag, kw in _FLAGS.items():
        p.add_argument(f"--{flag}", default=None, **kw)
    p.add_argument("--no-connector", action="store_true", help="local prefix caching only")
    p.add_argument(
        "--address",
        default="auto",
        help="Ray cluster to join (default: auto, a running one, else start a local one); "
        "'local' always starts a new local one",
    )
    p.add_argument(
        "--replace",
        action="store_true",
        help="replace a kvmesh app already deployed on the cluster (e.g. one whose "
        "`kvmesh serve` was killed); without it, the command refuses",
    )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    settings = load_yaml(args.config) if args.config else {}
    for flag in _FLAGS:
        value = getattr(args, flag.replace("-", "_"))
        if value is not None:
            settings[flag.replace("-", "_")] = value
    if args.no_connector:
        settings["connector"] = False
    return ServeConfig.from_dict(with_env_api_key(shell_paths(settings)))


# Settings that name a file or directory on the nodes that run workers or proxies.
_PATH_SETTINGS = ("disk_cache_dir", "ssl_keyfile", "ssl_certfile")


def shell_paths(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` with relative paths made absolute from this shell's directory, as whoever
    typed them meant them: Ray runs workers and proxies in the directory where their node's
    ``ray start`` ran, which is this one only when ``kvmesh serve`` starts Ray itself. A model
    is a path only when it is a file or directory here (not a known name); the name clients
    send stays the one given."""
    out = dict(settings)
    for name in _PATH_SETTINGS:
        if isinstance(out.get(name), str) and out[name]:
            out[name] = os.path.abspath(os.path.expanduser(out[name]))
    model = out.get("model")
    if isinstance(model, str) and model not in KNOWN_MODELS:
        path = os.path.expanduser(model)
        if os.path.exists(path) and not os.path.isabs(model):
            if out.get("served_model_name") is None:
                out["served_model_name"] = model
            out["model"] = os.path.abspath(path)
    return out
