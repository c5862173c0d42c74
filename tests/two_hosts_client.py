"""The client side of the two-host scenarios: runs inside a host's network namespace.

``python -m tests.two_hosts_client COMMAND JSON`` runs one command with the JSON object as its
keyword arguments and prints its result as one JSON line (``TwoHosts.run_python`` reads it).
Requests go through the official ``openai`` client to ``kvmesh serve``'s HTTP API; the link's
byte counters are read from sysfs, which inside ``ip netns exec`` shows the host's own devices.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx2 as httpx
import openai

# The served model's name: tiny-random in tests; bench/chaos.py sets another for its run.
MODEL = os.environ.get("KVMESH_CLIENT_MODEL", "tiny-random")


def client(base_url: str, timeout: float = 120.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=timeout, max_retries=0)


def link_bytes(dev: str) -> int:
    stats = Path("/sys/class/net", dev, "statistics")
    return sum(int((stats / f).read_text()) for f in ("rx_bytes", "tx_bytes"))


def prompt(n_words: int, salt: int = 0) -> str:
    return " ".join(f"w{salt}x{i}" for i in range(n_words))


def complete(
    base_url: str,
    text: str,
    max_tokens: int,
    stream: bool = False,
    model: str = MODEL,
    on_first_text: Callable[[], None] | None = None,
    api: openai.OpenAI | None = None,
) -> dict[str, Any]:
    """One greedy completion: its text, its ``kvmesh`` object, its seconds, and when
    streamed the chunks that carried text and the seconds to the first (or an error's class,
    its HTTP status or cause, never raised). A stream calls ``on_first_text`` when its first
    text arrives. ``api``: a client to reuse (its connections kept alive), else a new one."""
    body = {"ignore_eos": True}
    try:
        c = api or client(base_url)
        start = time.perf_counter()
        if not stream:
            r = c.completions.create(
                model=model, prompt=text, max_tokens=max_tokens, temperature=0, extra_body=body
            )
            seconds = time.perf_counter() - start
            kv = r.model_extra["kvmesh"]
            return {"ok": True, "text": r.choices[0].text, "kvmesh": kv, "seconds": seconds}
        parts, kv, ttft = [], None, None
        for chunk in c.completions.create(
            model=model,
            prompt=text,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body=body,
        ):
            if chunk.choices and chunk.choices[0].text:
                if ttft is None:
                    ttft = time.perf_counter() - start
                    if on_first_text is not None:
                        on_first_text()
                parts.append(chunk.choices[0].text)
            kv = (chunk.model_extra or {}).get("kvmesh", kv)
        text = "".join(parts)
        seconds = time.perf_counter() - start
        return {
            "ok": True,
            "text": text,
            "kvmesh": kv,
            "chunks": len(parts),
            "ttft_s": ttft,
            "seconds": seconds,
        }
    except openai.APIStatusError as e:
        return {"ok": False, "error": type(e).__name__, "status": e.status_code}
    except (openai.APIError, httpx.HTTPError) as e:
        # The cause tells a refused connection (ConnectError: nothing sent) from a cut one.
        cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
        return {"ok": False, "error": type(e).__name__, "cause": cause}


def wait_ready(
    base_url: str, timeout: float = 240.0, model: str = MODEL, workers: int = 1
) -> dict[str, Any]:
    """Until completions succeed on ``workers`` different workers (the app deployed and that
    many workers answer: under round robin, consecutive requests then alternate)."""
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    seen: set[str] = set()
    while time.monotonic() < deadline:
        last = complete(base_url, f"hello {len(seen)} {time.monotonic()}", 2, model=model)
        if last["ok"]:
            seen.add(last["kvmesh"]["worker"])
            if len(seen) >= workers:
                return {"ready": True, "after_s": round(timeout - (deadline - time.monotonic()), 1)}
            continue
        time.sleep(1.0)
    return {"ready": False, "last": last, "workers": sorted(seen)}


def pull(base_url: str, dev: str, words: int, max_tokens: int = 4) -> dict[str, Any]:
    """The same prompt twice (round robin puts them on two workers): the second pulls. Link
    bytes counted around each request."""
    text = prompt(words, salt=int(time.time() * 1000) % 100000)
    out = []
    for _ in range(2):
        before, t = link_bytes(dev), time.perf_counter()
        res = complete(base_url, text, max_tokens)
        res["seconds"] = time.perf_counter() - t
        res["link_bytes"] = link_bytes(dev) - before
        out.append(res)
    return {"requests": out}


def streamed(i: int) -> bool:
    """Whether ``traffic`` streams its ``i``-th request: every other one."""
    return i % 2 == 1


def traffic(
    base_url: str, texts: list[str], max_tokens: int, concurrency: int = 16, announce: bool = False
) -> dict:
    """Every text once, greedy, every other one streamed; results in order. With
    ``announce``, prints ``{"streaming": n}`` first, once each of the n streams has had text:
    the load is then under way on the workers, however fast or slow the machine."""
    streams = sum(map(streamed, range(len(texts))))
    waiting = streams
    lock = threading.Lock()

    def first_text() -> None:
        nonlocal waiting
        with lock:
            waiting -= 1
            if waiting == 0:
                print(json.dumps({"streaming": streams}), flush=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [
            pool.submit(
                complete,
                base_url,
                t,
                max_tokens,
                streamed(i),
                on_first_text=first_text if announce else None,
            )
            for i, t in enumerate(texts)
        ]
        results = [f.result() for f in futures]
    return {"results": results, "seconds": round(time.perf_counter() - start, 3)}


def reference(texts: list[str], max_tokens: int, num_kv_blocks: int = 8192) -> dict[str, Any]:
    """What ``traffic`` gets for ``texts`` with no fault, in order, from an in-process engine
    on ``MODEL``: each streamed request's text as its deltas join, each other's as its output
    gives it (as the API serves them). Greedy, so a served output differs from it only if a
    fault changed it. The default pool holds 64 prompts of ~550 tokens in 16-token blocks."""
    from kvmesh import LLM, SamplingParams

    llm = LLM(MODEL, num_kv_blocks=num_kv_blocks, progress=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    joined: dict[str, list[str]] = {}
    finished: dict[str, Any] = {}  # request id -> its RequestOutput
    for delta in llm.stream(texts, params):
        joined.setdefault(delta.request_id, []).append(delta.text)
        if delta.output is not None:
            finished[delta.request_id] = delta.output
    by_text = {out.prompt: (rid, out.text) for rid, out in finished.items()}
    results = []
    for i, text in enumerate(texts):
        rid, whole = by_text[text]
        results.append({"ok": True, "text": "".join(joined[rid]) if streamed(i) else whole})
    return {"results": results}


COMMANDS = {"wait_ready": wait_ready, "pull": pull, "traffic": traffic}

if __name__ == "__main__":
    result = COMMANDS[sys.argv[1]](**json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
