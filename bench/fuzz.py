"""Fuzzing: schemathesis against the app's OpenAPI schema, over real HTTP, plus the hostile
requests of issue #12 (a 50 MB body, max_tokens 10^9, 2,000 stop strings, a context
overflow, wrong types, NaN).

Every route gets ``--cases`` generated cases (issue #12: >= 1,000 a route), split evenly
between its generation modes: valid requests, and for routes with inputs, requests that break
the schema. Each is checked by schemathesis: no 5xx, the status, content type and body one
the schema documents. A case with no answer within ``--hang`` seconds is sent again with ten
times as long: no answer then is a hang, an answer is listed as slow (a long generation on a
loaded machine) and checked like the rest.
Generation requests carry the API key (so their bodies reach validation); the GET routes'
cases without it are the ones that fuzz the key. ``/health`` takes no input: its one case is
sent ``--cases`` times. One JSON line.

By default the app is ``build_api`` over a ``LocalBackend`` on tiny-random (a real engine),
behind uvicorn on loopback; ``--cluster`` deploys the Serve app (tiny-random, one worker, a
local Ray) and fuzzes it through Serve's proxy; ``--url`` fuzzes a running server. The local
apps' context is ``--max-model-len`` (64 tokens by default, so that each generated request is
cheap; 0: the model's, where a case may generate 2048 tokens). ``run_fuzz(base_url, ...)`` is
the scenario as a function.

    cd bench && ../.venv/bin/python fuzz.py [--cases 1000] [--cluster --cases 100]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.openai_helpers import strict_json


@schemathesis.check
def strict_json_body(ctx: Any, response: Any, case: schemathesis.Case) -> None:
    """The body (each event's data in a stream) is JSON a strict parser reads: no NaN or
    +-Infinity, which Python's json writes and reads and the schema check lets through."""
    text = response.content.decode("utf-8", "replace")
    kind = response.headers.get("content-type", [""])
    kind = kind[0] if isinstance(kind, list) else kind
    if kind.startswith("text/event-stream"):
        docs = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
        docs = [d for d in docs if d != "[DONE]"]
    elif kind.startswith("application/json"):
        docs = [text]
    else:
        return

    for doc in docs:
        strict_json(doc)


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    strict_json_body,
]
KEY = "fuzz-key"
SLOW_FACTOR = 10  # a case unanswered after hang_s gets this many times as long, once


@dataclass
class _Report:
    failures: list[str] = field(default_factory=list)
    slow: list[dict[str, Any]] = field(default_factory=list)
    hangs: int = 0
    wrong: int = 0  # answers that broke a check (status, schema): counted in failed too


def _route_cases(
    base_url: str,
    op: Any,
    mode: GenerationMode,
    n: int,
    auth: dict[str, str],
    hang_s: float,
    report: _Report,
    rng_seed: int,
) -> tuple[int, set[str], int]:
    """Run ``n`` generated cases of one operation; (cases, distinct inputs, failed).

    A case unanswered after ``hang_s`` is sent again with ``SLOW_FACTOR`` times as long: an
    answer then makes it slow (listed with its sampling fields, and checked like any other),
    none makes it a hang."""
    ran, distinct, failed = 0, set(), 0
    route = f"{op.method.upper()} {op.path}"

    def call(case: schemathesis.Case) -> Any:
        try:
            return case.call(base_url=base_url, headers=auth, timeout=hang_s)
        except requests.Timeout:
            start = time.perf_counter()
            response = case.call(base_url=base_url, headers=auth, timeout=hang_s * SLOW_FACTOR)
            took = round(time.perf_counter() - start, 1)
            report.slow.append({"route": route, "s": took, "request": _fields(case.body)})
            return response

    def one(case: schemathesis.Case) -> None:
        nonlocal ran, failed
        ran += 1
        distinct.add(repr((case.path_parameters, case.headers, case.query, case.body)))
        try:
            response = call(case)
            case.validate_response(response, checks=CHECKS, headers=auth)
        except requests.Timeout:
            failed += 1
            report.hangs += 1
            report.failures.append(f"{route}: hang (> {hang_s * SLOW_FACTOR} s)")
        except requests.RequestException as e:
            failed += 1
            report.failures.append(f"{route}: {type(e).__name__}")
        except (Exception, FailureGroup) as e:  # failed checks (FailureGroup: several)
            failed += 1
            report.wrong += 1
            report.failures.append(f"{route} {mode.value}: {str(e)[:400]}")

    @seed(rng_seed)
    @given(op.as_strategy(generation_mode=mode))
    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case: schemathesis.Case) -> None:
        one(case)

    run()
    # An input space smaller than n (a route without inputs) ends early: send its cases
    # again until n were sent, so every route takes the same number of requests.
    while 0 < ran < n:
        run_again = ran
        run()
        if ran == run_again:
            break
    return ran, distinct, failed


def _fields(body: Any) -> Any:
    """A generated body with its prompt or messages reduced to their size."""
    if not isinstance(body, dict):
        return type(body).__name__
    out = {k: v for k, v in body.items() if k not in ("prompt", "messages")}
    for k in ("prompt", "messages"):
        if k in body:
            out[f"{k}_chars"] = len(json.dumps(body[k]))
    return out


def _hostile(base_url: str, model: str, auth: dict[str, str], hang_s: float) -> dict[str, Any]:
    """Named hostile requests and the status each must get (a 200's body strict JSON)."""
    url = f"{base_url}/v1/completions"
    base = {"model": model, "prompt": "hi", "max_tokens": 4}
    cases: dict[str, tuple[Any, int]] = {
        "body_50mb": (b'{"prompt": "' + b"a" * (50 << 20) + b'"}', 413),
        "max_tokens_1e9": ({**base, "max_tokens": 10**9}, 400),
        "stop_2000_strings": ({**base, "stop": [f"s{i}" for i in range(2000)]}, 400),
        "context_overflow": ({**base, "prompt": [1] * 100_000}, 400),
        "wrong_type_max_tokens": ({**base, "max_tokens": "10"}, 400),
        "wrong_type_prompt": ({**base, "prompt": {"a": 1}}, 400),
        "temperature_nan": (json.dumps(base)[:-1].encode() + b', "temperature": NaN}', 400),
        "temperature_1e308": ({**base, "temperature": 1e308}, 400),
        "top_k_1e12": ({**base, "top_k": 10**12}, 400),
        "seed_2_80": ({**base, "seed": 2**80}, 400),
        "not_json": (b"{not json", 400),
        # A grammar leaving one token: the others' logprobs are -inf, which JSON cannot say.
        "masked_logprobs": ({**base, "logprobs": 5, "structured_outputs": {"choice": ["a"]}}, 200),
    }
    out: dict[str, Any] = {}
    for name, (body, want) in cases.items():
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {**auth, "Content-Type": "application/json"}
        start = time.perf_counter()
        try:
            response = requests.post(url, data=data, headers=headers, timeout=hang_s)
            status = response.status_code
            if status == 200:
                strict_json(response.text)
        except AssertionError:
            status = "not JSON"
        except requests.Timeout:
            status = "hang"
        except requests.ConnectionError:
            # Refused before the upload ended: the server answered and closed; what it said
            # is what a client that reads before it finishes sending sees (curl does).
            status = "closed"
        out[name] = {
            "status": status,
            "want": want,
            "ok": status == want or (want == 413 and status == "closed"),
            "s": round(time.perf_counter() - start, 2),
        }
    return out


def run_fuzz(
    base_url: str,
    model: str,
    *,
    cases_per_route: int = 1000,
    api_key: str | None = KEY,
    hang_s: float = 30.0,
    rng_seed: int = 0,
) -> dict[str, Any]:
    """Fuzz the server at ``base_url`` from its own ``/openapi.json``; one dict."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = _Report()
    by_route: dict[str, dict[str, float]] = {}
    started = time.perf_counter()
    for result in schema.get_all_operations():
        op = result.ok()
        route = f"{op.method.upper()} {op.path}"
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST" or (api_key and op.path != "/health"):
            modes.append(GenerationMode.NEGATIVE)
        row = {"cases": 0, "distinct": 0, "failed": 0}
        route_started = time.perf_counter()
        for i, mode in enumerate(modes):
            n_mode = cases_per_route // len(modes) + (i < cases_per_route % len(modes))
            # Bodies are what a generation route's negative cases fuzz: they carry the key.
            # A GET route's negative cases fuzz the key itself.
            keyed = auth if mode == GenerationMode.POSITIVE or op.method.upper() == "POST" else {}
            n, distinct, failed = _route_cases(
                base_url, op, mode, n_mode, keyed, hang_s, report, rng_seed
            )
            row["cases"] += n
            row["distinct"] += len(distinct)
            row["failed"] += failed
        row["s"] = round(time.perf_counter() - route_started, 1)  # where the fuzz's time goes
        by_route[route] = row
    hostile = _hostile(base_url, model, auth, hang_s)
    health = requests.get(f"{base_url}/health", timeout=hang_s).status_code
    failed = sum(r["failed"] for r in by_route.values())
    failed += sum(not h["ok"] for h in hostile.values()) + (health != 200)
    return {
        "scenario": "fuzz",
        "requests": sum(r["cases"] for r in by_route.values()) + len(hostile),
        "failed": failed,
        "wrong": report.wrong,
        "cases_per_route": min(r["cases"] for r in by_route.values()),
        "by_route": by_route,
        "hostile": {name: h["status"] for name, h in hostile.items()},
        "hostile_failed": [name for name, h in hostile.items() if not h["ok"]],
        "body_50mb_s": hostile["body_50mb"]["s"],
        "failures": report.failures[:10],
        "hangs": report.hangs,
        "slow": report.slow[:10],
        "wall_s": round(time.perf_counter() - started, 1),
    }


@contextmanager
def _cluster_server(model: str, api_key: str, max_model_len: int | None) -> Iterator[str]:
    """The Serve app (one worker) on a local Ray; its URL."""
    import ray
    from ray import serve

    from kvmesh.cluster.config import ServeConfig
    from kvmesh.cluster.serve_app import deploy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServeConfig(
        model=model,
        workers=1,
        api_key=api_key,
        kv_cache_memory="64MiB",
        port=port,
        max_model_len=max_model_len,
    )
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        deploy(config)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def _local_server(model: str, api_key: str, max_model_len: int | None) -> Iterator[str]:
    """build_api over a LocalBackend on ``model`` behind uvicorn on loopback; its URL."""
    import uvicorn

    from kvmesh.cluster.admission import Admission
    from kvmesh.cluster.local_backend import LocalBackend
    from kvmesh.cluster.openai_api import build_api

    backend = LocalBackend(
        model=model, block_size=4, num_kv_blocks=64, max_model_len=max_model_len, progress=False
    )
    app = build_api(backend, model_name=model, api_key=api_key, admission=Admission(64))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        backend.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=1000, help="per route, split across its modes")
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--cluster", action="store_true", help="fuzz the Serve app (local Ray)")
    ap.add_argument(
        "--max-model-len", type=int, default=64, help="the local app's context (0: the model's)"
    )
    ap.add_argument("--url", help="fuzz this running server instead of a local one")
    ap.add_argument("--api-key", help="the running server's key (with --url)")
    ap.add_argument("--hang", type=float, default=30.0, help="seconds that make a hang")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kw = {"cases_per_route": args.cases, "hang_s": args.hang, "rng_seed": args.seed}
    if args.url:
        out = run_fuzz(args.url.rstrip("/"), args.model, api_key=args.api_key, **kw)
    else:
        server = _cluster_server if args.cluster else _local_server
        with server(args.model, KEY, args.max_model_len or None) as url:
            out = run_fuzz(url, args.model, api_key=KEY, **kw)
    backend = args.url or ("cluster" if args.cluster else "local")
    context = None if args.url else args.max_model_len
    print(json.dumps({**out, "model": args.model, "backend": backend, "max_model_len": context}))


if __name__ == "__main__":
    main()
