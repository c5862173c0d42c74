"""The ``slow_link`` scenario of bench/chaos.py (run by bench/chaos_driver.py inside host a):
kv_aware on a shaped link, where followers of a long prompt sent off its holder must pull it
while that is cheaper and compute it once the router has measured that pulling is slower."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from tests.two_hosts_client import complete, prompt


def slow_link(base_url: str, prefixes: int, followers: int, words: int, max_tokens: int) -> dict:
    """kv_aware on the link as it is shaped now: for each of ``prefixes`` fresh long prompts,
    one request computes it, then ``followers`` requests sharing it arrive together. The
    holder has one queue, so the router sends some to the other worker, which pulls the
    prefix or computes it, as the learned costs say. Each follower's prompt is asked again
    at the end (a local hit) and must give the same text."""
    rows, texts_seen = [], []
    salt = int(time.time()) % 100000
    with ThreadPoolExecutor(followers) as pool:
        for i in range(prefixes):
            head = prompt(words, salt=salt * 100 + i)
            first = complete(base_url, head, 1)
            tails = [prompt(4, salt=salt * 100 + i * 10 + j + 1) for j in range(followers)]
            asks = [f"{head} {tail}" for tail in tails]
            got = list(pool.map(lambda t: complete(base_url, t, max_tokens), asks))
            holder = (first.get("kvmesh") or {}).get("worker")
            for text, r in zip(asks, got, strict=True):
                kv = r.get("kvmesh") or {}
                moved = r["ok"] and kv.get("worker") != holder
                rows.append({"ok": r["ok"], "moved": moved, "kv": kv, "prefix": i})
                texts_seen.append((text, r.get("text")))
            rows.append({"ok": first["ok"], "moved": False, "kv": first.get("kvmesh") or {}})
    again = [complete(base_url, t, max_tokens) for t, _ in texts_seen]
    wrong = sum(a["ok"] and a["text"] != t for a, (_, t) in zip(again, texts_seen, strict=True))
    moved = [r for r in rows if r["moved"]]
    pulled = [r for r in moved if r["kv"].get("pulled_tokens")]
    computed = [r for r in moved if not r["kv"].get("pulled_tokens")]

    def median_ttft(rs: list[dict]) -> float | None:
        v = sorted(r["kv"]["ttft_ms"] for r in rs)
        return v[len(v) // 2] if v else None

    half = prefixes // 2
    return {
        "requests": len(rows) + len(again),
        "failed": sum(not r["ok"] for r in rows) + sum(not a["ok"] for a in again),
        "wrong": wrong,
        "prompt_tokens": rows[-1]["kv"].get("computed_tokens"),
        "moved": len(moved),
        "moved_pulled": len(pulled),
        "moved_computed": len(computed),
        "pulled_first_half": sum(r["prefix"] < half for r in pulled),
        "pulled_second_half": sum(r["prefix"] >= half for r in pulled),
        # A pull of the few blocks a peer finished first is cheap on any link; a whole
        # prefix over a slow one is what must stop.
        "max_pull_tokens_second_half": max(
            (r["kv"]["pulled_tokens"] for r in pulled if r["prefix"] >= half), default=0
        ),
        "ttft_pulled_ms": median_ttft(pulled),
        "ttft_computed_ms": median_ttft(computed),
        # Per prefix, each follower: "h" at the holder, "p" moved and pulled, "c" moved and
        # computed; its TTFT in ms.
        "placements": [
            " ".join(
                f"{'p' if r['kv'].get('pulled_tokens') else 'c' if r['moved'] else 'h'}"
                f"{round(r['kv'].get('ttft_ms') or 0)}"
                for r in rows
                if r.get("prefix") == i
            )
            for i in range(prefixes)
        ],
    }
