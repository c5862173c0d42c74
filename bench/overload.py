"""Overload: 4x the sustainable request rate, open loop, against the HTTP API.

First the sustainable rate: a closed loop of ``--concurrency`` clients (default: what the
workers run at once) for ``--probe`` seconds. Then ``--factor`` times that rate, open loop
(arrivals on a fixed schedule, whatever the answers), for ``--duration`` seconds; half the
requests stream. Reported, one JSON line:

- ``failed``: 5xx other than 503, a 4xx other than 429, a transport error or a hang (no
  answer within ``--hang`` seconds); ``rejected``: 429 and 503 answers, and
  ``retry_after_present`` the share of them with a ``Retry-After`` header, and
  ``openai_body`` the share with OpenAI's error body (the rest are Serve proxy's own text);
- ``wrong``: admitted answers (greedy) that differ from the unloaded reference;
- admitted latency p50 / p99 (whole answer) against the closed loop's;
- resident memory of the ingress and worker processes at the start, halfway through the
  overload and at the end: flat means no growth from the middle to the end.

``run_overload(base_url, ...)`` is the scenario as a function, for other benches (the
chaos suite runs it against its own cluster).

    cd bench && ../.venv/bin/python overload.py [--duration 60] [--model tiny-random]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import psutil
import ray
from ray import serve
from stats import percentile

from kvmesh.cluster.config import ServeConfig
from kvmesh.cluster.serve_app import deploy

REJECTED = (429, 503)


def prompts(n: int) -> list[list[int]]:
    """Distinct short token-id prompts (no shared prefix: the point is load, not reuse)."""
    return [[7 + i, 3 + 2 * i, 11, 5 + i % 7, 13 + i] for i in range(n)]


async def _one(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], hang_s: float
) -> dict[str, Any]:
    """One request: status, seconds, the answer's text (admitted) and Retry-After."""
    start = time.perf_counter()
    out: dict[str, Any] = {"status": None, "text": None, "retry_after": None}

    async def call() -> str:
        async with session.post(url, json=body) as r:
            out["status"] = r.status
            out["retry_after"] = r.headers.get("Retry-After")
            return await r.text()

    try:
        raw = await asyncio.wait_for(call(), hang_s)
        if out["status"] == 200:
            out["text"] = _stream_text(raw) if body.get("stream") else _text(json.loads(raw))
        elif out["status"] in REJECTED:
            out["openai_body"] = _is_error_body(raw)
    except TimeoutError:
        out["error"] = "hang"
    except (aiohttp.ClientError, ValueError, KeyError) as e:
        out["error"] = type(e).__name__
    out["s"] = time.perf_counter() - start
    return out


def _is_error_body(raw: str) -> bool:
    try:
        error = json.loads(raw)["error"]
        return isinstance(error["type"], str) and isinstance(error["code"], str)
    except (ValueError, KeyError, TypeError):
        return False


def _text(answer: dict[str, Any]) -> str:
    return answer["choices"][0]["text"]


def _stream_text(raw: str) -> str | None:
    """The text of an SSE stream; None when it carried an error event or no [DONE]."""
    parts, done = [], False
    for line in raw.splitlines():
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            event = json.loads(line[len("data: ") :])
            if "error" in event:
                return None
            parts += [c["text"] for c in event["choices"]]
    return "".join(parts) if done else None


def _outcome(r: dict[str, Any]) -> str:
    """admitted (a whole answer), rejected (429 / 503), or failed (anything else, a stream
    that ended in an error event or without [DONE] included)."""
    if "error" in r:
        return "failed"
    if r["status"] == 200 and r["text"] is not None:
        return "admitted"
    return "rejected" if r["status"] in REJECTED else "failed"


def _pct(values: list[float], q: float) -> float | None:
    """The ``q``-quantile of ``values`` (seconds) in milliseconds."""
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 1)


async def _closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    seconds: float,
    hang_s: float,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    deadline = time.perf_counter() + seconds

    async def client(c: int) -> None:
        i = c
        while time.perf_counter() < deadline:
            r = await _one(session, url, bodies[i % len(bodies)], hang_s)
            results.append({**r, "i": i % len(bodies)})
            i += concurrency

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return results


async def _open_loop(
    session: aiohttp.ClientSession,
    url: str,
    bodies: list[dict[str, Any]],
    rate: float,
    seconds: float,
    hang_s: float,
) -> tuple[list[dict[str, Any]], float]:
    """Arrivals every 1/rate seconds for ``seconds``, each sent whether or not the earlier
    ones were answered; the answers, and the seconds it took to send them all."""
    n = int(rate * seconds)

    async def send(i: int) -> dict[str, Any]:
        r = await _one(session, url, bodies[i % len(bodies)], hang_s)
        return {**r, "i": i % len(bodies), "late": i >= n // 2}

    tasks = []
    start = time.perf_counter()
    for i in range(n):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(send(i)))
    sent_s = time.perf_counter() - start
    return list(await asyncio.gather(*tasks)), sent_s


async def _run(
    base_url: str,
    model: str,
    *,
    duration_s: float,
    factor: float,
    rate_rps: float | None,
    concurrency: int,
    probe_s: float,
    max_tokens: int,
    hang_s: float,
    distinct: int,
    rss: Callable[[], dict[str, int]] | None,
) -> dict[str, Any]:
    url = f"{base_url}/v1/completions"
    base = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    bodies = [{**base, "prompt": p, "stream": i % 2 == 1} for i, p in enumerate(prompts(distinct))]
    # The client must not be the bottleneck: no cap on its connections (kept alive, as
    # the OpenAI client keeps them).
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        reference = []
        for b in bodies:
            r = await _one(session, url, {**b, "stream": False}, hang_s)
            if r["status"] != 200:
                raise RuntimeError(f"reference request failed: {r}")
            reference.append(r["text"])
        rss_start = rss() if rss else {}
        load_start = os.getloadavg()[0]
        probe_start = time.perf_counter()
        closed = await _closed_loop(session, url, bodies, concurrency, probe_s, hang_s)
        ok = [r for r in closed if _outcome(r) == "admitted"]
        sustainable = len(ok) / (time.perf_counter() - probe_start)
        rate = rate_rps or factor * sustainable
        started = time.perf_counter()
        mid: dict[str, int] = {}

        async def look_halfway() -> None:
            await asyncio.sleep(duration_s / 2)
            mid.update(await asyncio.to_thread(rss) if rss else {})

        halfway = asyncio.create_task(look_halfway())
        results, sent_s = await _open_loop(session, url, bodies, rate, duration_s, hang_s)
        await halfway
        wall = time.perf_counter() - started
        after = await _one(session, url, {**bodies[0], "stream": False}, hang_s)
    # Let the processes settle (stream buffers freed, GC) before the last look.
    await asyncio.sleep(2.0)
    rss_end = rss() if rss else {}

    admitted = [r for r in results if _outcome(r) == "admitted"]
    rejected = [r for r in results if _outcome(r) == "rejected"]
    wrong = [r for r in admitted if r["text"] != reference[r["i"]]]
    mb = 1 << 20
    return {
        "scenario": "overload",
        "requests": len(results),
        "failed": sum(_outcome(r) == "failed" for r in results),
        "wrong": len(wrong),
        "rejected": len(rejected),
        "admitted": len(admitted),
        "openai_body": (
            round(sum(r.get("openai_body", False) for r in rejected) / len(rejected), 3)
            if rejected
            else None
        ),
        "retry_after_present": (
            round(sum(r["retry_after"] is not None for r in rejected) / len(rejected), 3)
            if rejected
            else None
        ),
        "hangs": sum(r.get("error") == "hang" for r in results),
        "statuses": dict(sorted(collections.Counter(str(r["status"]) for r in results).items())),
        "probe_requests": len(closed),
        "probe_not_admitted": sum(_outcome(r) != "admitted" for r in closed),
        "sustainable_rps": round(sustainable, 2),
        "offered_rps": round(rate, 2),
        "achieved_offered_rps": round(len(results) / sent_s, 2),
        # Admitted answers per second, from the first arrival until the last answer.
        "goodput_rps": round(len(admitted) / wall, 2),
        "duration_s": duration_s,
        "closed_loop_p50_ms": _pct([r["s"] for r in ok], 0.5),
        "closed_loop_p99_ms": _pct([r["s"] for r in ok], 0.99),
        "admitted_p50_ms": _pct([r["s"] for r in admitted], 0.5),
        "admitted_p99_ms": _pct([r["s"] for r in admitted], 0.99),
        # An unbounded queue's latency grows with time; a bounded one's does not.
        "admitted_p99_first_half_ms": _pct([r["s"] for r in admitted if not r["late"]], 0.99),
        "admitted_p99_second_half_ms": _pct([r["s"] for r in admitted if r["late"]], 0.99),
        "rejected_p99_ms": _pct([r["s"] for r in rejected], 0.99),
        "served_after": after["status"] == 200 and after["text"] == reference[0],
        # This machine's 1-minute load average before and after: a loaded box slows every
        # process here, the refusals included.
        "loadavg_1m": [round(load_start, 1), round(os.getloadavg()[0], 1)],
        "rss_start_mb": {k: round(v / mb, 1) for k, v in rss_start.items()},
        "rss_mid_mb": {k: round(v / mb, 1) for k, v in mid.items()},
        "rss_end_mb": {k: round(v / mb, 1) for k, v in rss_end.items()},
    }


def run_overload(
    base_url: str,
    model: str,
    *,
    duration_s: float = 60.0,
    factor: float = 4.0,
    rate_rps: float | None = None,
    concurrency: int = 8,
    probe_s: float = 20.0,
    max_tokens: int = 16,
    hang_s: float = 120.0,
    distinct: int = 16,
    rss: Callable[[], dict[str, int]] | None = None,
) -> dict[str, Any]:
    """The overload scenario against a served app at ``base_url`` (``http://host:port``);
    ``rss`` returns the resident bytes of the processes to watch, by name."""
    return asyncio.run(
        _run(
            base_url,
            model,
            duration_s=duration_s,
            factor=factor,
            rate_rps=rate_rps,
            concurrency=concurrency,
            probe_s=probe_s,
            max_tokens=max_tokens,
            hang_s=hang_s,
            distinct=distinct,
            rss=rss,
        )
    )


def serve_rss() -> dict[str, int]:
    """Resident bytes of this Ray cluster's kvmesh processes on this machine, summed by kind
    (ingress replicas, worker replicas, engine actors), from the GCS's actor table."""
    from ray._private.state import actors

    kinds = {
        "ServeReplica:kvmesh:KvmeshServer": "ingress",
        "ServeReplica:kvmesh:kvmesh-worker": "worker_replicas",
        "WorkerActor": "engines",
    }
    out: dict[str, int] = {}
    for a in actors().values():
        kind = kinds.get(a["ActorClassName"])
        if kind is None or a["State"] != "ALIVE" or not a["Pid"]:
            continue
        try:
            out[kind] = out.get(kind, 0) + psutil.Process(a["Pid"]).memory_info().rss
        except psutil.Error:
            continue
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-queued-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of overload")
    ap.add_argument("--probe", type=float, default=20.0, help="seconds of closed loop")
    ap.add_argument("--factor", type=float, default=4.0, help="times the sustainable rate")
    ap.add_argument(
        "--rate", type=float, help="offer this many requests a second instead (comparisons)"
    )
    ap.add_argument("--hang", type=float, default=120.0, help="seconds that make a hang")
    args = ap.parse_args()

    config = ServeConfig(
        model=args.model,
        workers=args.workers,
        max_num_seqs=args.max_num_seqs,
        max_queued_requests=args.max_queued_requests,
        kv_cache_memory="64MiB",
        num_cpus_per_worker=1.0,
        port=_free_port(),
    )
    ray.init(
        address="local", num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False
    )
    try:
        deploy(config)
        out = run_overload(
            f"http://127.0.0.1:{config.port}",
            config.model_name,
            duration_s=args.duration,
            factor=args.factor,
            rate_rps=args.rate,
            concurrency=config.worker_capacity,
            probe_s=args.probe,
            max_tokens=args.max_tokens,
            hang_s=args.hang,
            rss=serve_rss,
        )
        out = {
            **out,
            "model": args.model,
            "workers": args.workers,
            "admission_limit": config.admission_limit,
        }
        print(json.dumps(out))
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
