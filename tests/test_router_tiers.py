"""The router's view of KV in tiers: each medium charged its measured cost, a peer's tier
blocks charged their promotion, and one rule for what a peer can pull, shared by the index,
the plan's holder and the router's view (no Ray)."""

import pytest

from kvmesh.cluster.request_router import _holder
from kvmesh.cluster.router import Router, WorkerView
from kvmesh.connector.events import EventBatch, Stored, encode_batch
from kvmesh.connector.holder_sets import pullable_depths
from kvmesh.connector.kv_index import KvIndex

BS = 16


def test_kv_aware_charges_each_tier_its_cost() -> None:
    """b holds the prompt on its disk tier, c in its pool, a nothing: each medium at its
    measured cost against computing and pulling."""
    tokens = 64 * BS + 5
    r = Router("kv_aware", BS)
    r.cost.t_token_s, r.cost.t_pull_block_s = 1e-3, 5e-3
    r.cost.t_disk_block_s = 2e-3
    tiered = {"b": WorkerView(host_depth=0, disk_depth=64)}
    c = r.choose(["a", "b"], tiered, tokens)
    assert (c.worker, c.local_blocks, c.pull_blocks, c.compute_tokens) == ("b", 0, 0, 5)
    assert c.estimated_ttft_s == pytest.approx(64 * 2e-3 + 5e-3)
    # A disk slower than computing: b still serves it from disk (its connector loads what
    # its tiers hold), so a, computing everything, wins.
    r.cost.t_disk_block_s = 0.1
    assert r.choose(["a", "b"], tiered, tokens).worker == "a"
    # Host memory beats a peer's pool, which beats b's slow disk.
    r.cost.t_host_block_s = 1e-4
    views = {"b": WorkerView(disk_depth=64), "c": WorkerView(host_depth=64, disk_depth=64)}
    views["d"] = WorkerView(depth=64, queue=40)  # holds it in its pool, but busy
    c = r.choose(["a", "b", "c", "d"], views, tokens)
    assert c.worker == "c" and c.pull_blocks == 0
    # Part in its pool, the next part in host memory, the rest on disk.
    r.cost.t_disk_block_s = 2e-3
    v = WorkerView(depth=10, host_depth=30, disk_depth=64)
    c = r.choose(["b"], {"b": v}, tokens)
    expect = 20 * 1e-4 + 34 * 2e-3 + 5e-3
    assert c.local_blocks == 10 and c.estimated_ttft_s == pytest.approx(expect)
    # A peer's pool holding more than the tiers: the worker pulls it all from the peer.
    views = {"b": WorkerView(disk_depth=20), "c": WorkerView(depth=64, queue=40)}
    c = r.choose(["b"], views, tokens)
    assert c.pull_blocks == 64 and c.local_blocks == 0


def test_a_pull_from_a_peers_tiers_is_charged_its_promotion() -> None:
    """The holder copies tier blocks into its pool under the pin before the read: each such
    block costs its tier's copy on top of the pull, so a slow promotion makes the worker
    compute instead (before: priced as a pool pull, it pulled)."""
    tokens = 64 * BS + 5
    r = Router("kv_aware", BS)
    r.cost.t_token_s, r.cost.t_pull_block_s, r.cost.t_host_block_s = 1e-4, 1e-4, 1e-4
    views = {"a": WorkerView(), "c": WorkerView(depth=24, host_depth=64, queue=40)}
    c = r.choose(["a"], views, tokens)
    assert (c.pull_blocks, c.compute_tokens) == (64, 5)
    assert c.estimated_ttft_s == pytest.approx(64 * 1e-4 + 40 * 1e-4 + 5 * 1e-4)
    r.cost.t_host_block_s = 0.01  # 40 promotions: 0.4 s, against 0.1 s to compute it all
    c = r.choose(["a"], views, tokens)
    assert (c.pull_blocks, c.compute_tokens) == (0, tokens)
    # A peer with everything in its pool pulls at the plain pull cost.
    views["c"] = WorkerView(depth=64, host_depth=64, queue=40)
    assert r.choose(["a"], views, tokens).pull_blocks == 64
    # Pool, then host, then disk: each promoted block at its tier's cost.
    r.cost.t_host_block_s, r.cost.t_disk_block_s = 1e-4, 1e-3
    views["c"] = WorkerView(depth=24, host_depth=40, disk_depth=64, queue=40)
    c = r.choose(["a"], views, tokens)
    assert (c.pull_blocks, c.compute_tokens) == (64, 5)
    expect = 64 * 1e-4 + 16 * 1e-4 + 24 * 1e-3 + 5 * 1e-4
    assert c.estimated_ttft_s == pytest.approx(expect)


def test_the_plans_holder_is_the_deepest_pool_or_tier_of_any_worker() -> None:
    """Every worker the index knows counts, not only this deployment's replicas (the decode
    router pulls from a prefill worker); a holder's host and disk tiers count too."""
    r = Router("kv_aware", BS)
    info = {
        "held": {"prefill-1": 5, "decode-2": 3},
        "tiers": {
            "decode-3": {"device": 0, "host": 8, "disk": 8},
            "decode-4": {"device": 0, "host": 0, "disk": 20},
        },
    }
    assert _holder(info, "decode-2", r, 64) == "decode-4"
    assert _holder(info, "decode-4", r, 64) == "decode-3"
    del info["tiers"]["decode-4"]
    assert _holder(info, "decode-3", r, 64) == "prefill-1"
    assert _holder({"held": {"prefill-1": 5}}, "decode-2", r, 64) == "prefill-1"
    assert _holder({"held": {"decode-2": 5}}, "decode-2", r, 64) is None
    assert _holder({}, "decode-2", r, 64) is None


def tier_view(t: dict[str, int]) -> dict[str, int]:
    return {"host_depth": t["host"], "disk_depth": t["disk"]}


def test_the_index_the_plan_and_the_view_agree_on_what_a_peer_can_pull() -> None:
    """One rule (a holder's pool and its tiers) for the index's pull depths, the plan's holder
    and the router's view of a worker."""
    index = KvIndex("fp")
    hashes = [bytes([i]) * 16 for i in range(6)]
    events = {
        "a": (Stored(tuple(hashes[:2])), Stored(tuple(hashes[2:4]), hashes[1], "host")),
        "b": (Stored(tuple(hashes[:1])), Stored(tuple(hashes[1:]), hashes[0], "disk")),
    }
    for w, evs in events.items():
        token = index.register(w, "fp")
        assert index.apply(encode_batch(EventBatch(w, 0, evs)), token).status == "applied"
    held, tiers = index.lookup(hashes), index.tier_depths(hashes)
    r = Router("kv_aware", BS)
    assert pullable_depths(held, tiers) == index.pull_depths(hashes) == {"a": 4, "b": 6}
    assert index.pull_depths(hashes, exclude="b") == pullable_depths(held, tiers, "b") == {"a": 4}
    assert _holder({"held": held, "tiers": tiers}, "a", r, 6) == "b"
    assert _holder({"held": held, "tiers": tiers}, "b", r, 6) == "a"
    views = {w: WorkerView(held.get(w, 0), **tier_view(tiers[w])) for w in "ab"}
    assert {w: v.pull_depth for w, v in views.items()} == {"a": 4, "b": 6}
