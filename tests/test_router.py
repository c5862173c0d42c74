"""The router's choices over the measured costs, each worker at its own (no Ray)."""

import dataclasses
from types import SimpleNamespace

import pytest

from kvmesh.cluster.cost_model import CostModel
from kvmesh.cluster.request_router import (
    KvAwareRequestRouter,
    RoundRobinRequestRouter,
    _holder,
    not_lost_on,
    without,
)
from kvmesh.cluster.router import Router, WorkerView
from kvmesh.cluster.worker_deployment import worker_name
from kvmesh.cluster.worker_request import WorkerRequest
from kvmesh.connector.events import EventBatch, Stored, encode_batch
from kvmesh.connector.kv_index import KvIndex
from kvmesh.workers.sampling_params import SamplingParams

BS = 16


def queues(**q: int) -> dict[str, WorkerView]:
    return {w: WorkerView(queue=n) for w, n in q.items()}


def test_baselines() -> None:
    rr = Router("round_robin", BS)
    assert [rr.choose(["a", "b", "c"], {}).worker for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router("least_loaded", BS)
    assert ll.choose(["a", "b", "c"], queues(a=3, b=1, c=2)).worker == "b"
    with pytest.raises(ValueError, match="policy"):
        Router("random", BS)
    with pytest.raises(RuntimeError, match="no worker"):
        rr.choose([], {})


def test_kv_aware_prefers_the_holder_until_its_queue_costs_more() -> None:
    r = Router("kv_aware", BS)
    tokens = 64 * BS + 5
    assert r.choose(["a", "b"], {"b": WorkerView(depth=64)}, tokens).worker == "b"
    # b holds everything, a can pull it: with b busy enough, pulling on a wins.
    c = r.choose(["a", "b"], {"b": WorkerView(queue=50, depth=64)}, tokens)
    assert c.worker == "a" and c.pull_blocks == 64 and c.compute_tokens == 5
    # Without the connector nothing can be pulled: computing on a costs the whole prompt.
    local_only = Router("kv_aware", BS, connector=False)
    c = local_only.choose(["a", "b"], {"b": WorkerView(queue=5, depth=64)}, tokens)
    assert c.worker == "b" and c.pull_blocks == 0


def test_a_worker_without_room_in_its_pool_is_not_routed_to() -> None:
    """Peers pinned most of b's pool: a prompt that needs more blocks than b can give goes
    elsewhere, even though b holds its prefix. Blocks b's own running requests hold come back
    when they finish: they count as b's queue, and set b aside no more than a queue does."""
    tokens = 64 * BS + 5
    for policy in ("kv_aware", "least_loaded"):
        r = Router(policy, BS)
        # b holds 32 blocks: the prompt needs 33 more (32 + the partial one); b has 20.
        full = {
            "a": WorkerView(queue=1, room_blocks=500),
            "b": WorkerView(depth=32, room_blocks=20),
        }
        assert r.choose(["a", "b"], full, tokens).worker == "a"
        # With room for them, b is the one.
        roomy = {**full, "b": WorkerView(depth=32, room_blocks=33)}
        assert r.choose(["a", "b"], roomy, tokens).worker == "b"
        # None has room: the request queues where it would have anyway (never refused here).
        tight = {"a": WorkerView(queue=1, room_blocks=3), "b": WorkerView(depth=32, room_blocks=3)}
        assert r.choose(["a", "b"], tight, tokens).worker == "b"
    # A holder busy with one running request keeps its conversation (the history would be
    # computed elsewhere).
    busy = {"a": WorkerView(), "b": WorkerView(queue=1, depth=60, room_blocks=500)}
    assert Router("kv_aware", BS).choose(["a", "b"], busy, tokens).worker == "b"


def test_moving_a_conversation_costs_its_history_but_a_shared_prompt_moves_freely() -> None:
    """Blocks only one peer holds (a conversation's own history) cost their recompute when
    pulled elsewhere: the conversation stays home unless home is much busier. Blocks two
    peers hold (a shared prompt) are pulled at their transfer cost only."""
    r = Router("kv_aware", BS)
    tokens = 60 * BS + 5
    system = WorkerView(depth=34)
    views = {"a": WorkerView(queue=2, depth=60), "b": system, "c": system}
    assert r.choose(["a", "b", "c"], views, tokens).worker == "a"
    views["a"] = WorkerView(queue=50, depth=60)
    c = r.choose(["a", "b", "c"], views, tokens)
    assert c.worker in ("b", "c") and c.pull_blocks == 26
    shared = {"a": WorkerView(queue=2, depth=60), "b": WorkerView(), "c": WorkerView(depth=60)}
    c = r.choose(["a", "b"], shared, tokens)
    assert c.worker == "b" and c.pull_blocks == 60


def test_pending_prefix_is_local_to_its_worker_and_pullable_after_a_wait() -> None:
    r = Router("kv_aware", BS)
    tokens = 40 * BS + 3
    c = r.choose(
        ["a", "b"], {"a": WorkerView(queue=1, pending=40, pending_wait_tokens=640)}, tokens
    )
    assert c.worker == "a" and c.local_blocks == 40 and c.pull_blocks == 0 and c.wait_for is None
    # Only b: waiting for a to publish, then pulling, beats computing the same blocks again.
    other = r.choose(["b"], {"a": WorkerView(pending=40, pending_wait_tokens=640)}, tokens)
    assert other.wait_for == "a" and other.pull_blocks == 40 and other.compute_tokens == 3
    # Without the connector b can only compute.
    local_only = Router("kv_aware", BS, connector=False)
    c = local_only.choose(["b"], {"a": WorkerView(pending=40, pending_wait_tokens=640)}, tokens)
    assert c.wait_for is None and c.compute_tokens == tokens


def test_a_prefix_still_on_its_way_here_is_waited_for_at_its_source() -> None:
    """b will hold the prefix once an earlier request pulls it from a (which computes it).
    A request routed to b for its "local" blocks must wait for a as that earlier one does:
    it may reach b first (another ingress sent the earlier one), and would compute it."""
    r = Router("kv_aware", BS)
    tokens = 40 * BS + 3
    views = {
        "a": WorkerView(queue=3, pending=40, pending_wait_tokens=640),
        "b": WorkerView(pending=40, pending_wait_tokens=3),
    }
    c = r.choose(["a", "b"], views, tokens)
    assert c.worker == "b" and c.local_blocks == 40 and c.wait_for == "a"
    views["a"] = WorkerView(queue=3, depth=40)  # a holds it now: wait for (pull from) a
    assert r.choose(["a", "b"], views, tokens).wait_for == "a"
    # b computes the prefix itself (no peer has it): its scheduler makes this one wait.
    alone = r.choose(["b"], {"b": WorkerView(pending=40, pending_wait_tokens=643)}, tokens)
    assert alone.local_blocks == 40 and alone.wait_for is None
    views["b"] = WorkerView(depth=40)  # already here: nothing to wait for
    assert r.choose(["a", "b"], views, tokens).wait_for is None


def test_a_burst_sharing_a_prefix_spreads_and_computes_it_once() -> None:
    """Eight prompts with a shared 35-block prefix arrive at once on four idle workers (what
    the frontend sees as it records each choice): the prefix is computed by one worker, the
    others wait for it and pull, and no worker gets more than a fair share."""
    r = Router("kv_aware", BS)
    shared, own = 35, 6
    tokens = (shared + own) * BS + 5
    workers = ["w0", "w1", "w2", "w3"]
    inflight: dict[str, list[tuple[int, int]]] = {w: [] for w in workers}  # (shared?, tokens)
    computing_shared = []
    for _ in range(8):
        views = {}
        for w in workers:
            backlog = pending = wait = 0
            for depth, t in inflight[w]:
                backlog += t
                if depth > pending:
                    pending, wait = depth, backlog
            views[w] = WorkerView(len(inflight[w]), backlog, 0, pending, wait)
        c = r.choose(workers, views, tokens)
        if c.compute_tokens > own * BS + 5:
            computing_shared.append(c.worker)
        inflight[c.worker].append((shared, c.compute_tokens))
    assert len(computing_shared) == 1
    assert max(len(v) for v in inflight.values()) <= 3
    assert sum(1 for v in inflight.values() if v) >= 3


def test_pulls_that_fail_on_a_slow_link_teach_the_router_to_compute() -> None:
    """Pulls slower than computing: first reads that finish (0.5 s for 64 blocks, computing
    them takes 0.2 s), then reads that fail after their 2 s timeout. The router learns from
    both (a failed read costs its wait plus computing its blocks) and computes on the idle
    worker instead of pulling; the wait is not mistaken for compute time."""
    r = Router("kv_aware", BS)
    tokens = 64 * BS + 5
    views = {"b": WorkerView(queue=50, depth=64)}
    assert r.choose(["a", "b"], views, tokens).pull_blocks == 64  # the prior: pulls are cheap
    compute = dict(ttft_s=0.2, computed_tokens=tokens, pulled_blocks=0, queue_len=0)
    for _ in range(60):
        r.cost.observe(**compute)
        r.cost.observe(ttft_s=0.501, computed_tokens=5, pulled_blocks=64, queue_len=0, pull_s=0.5)
    assert r.cost.t_pull_block_s == pytest.approx(0.5 / 64, rel=0.01)
    c = r.choose(["a", "b"], views, tokens)
    assert c.worker == "a" and c.pull_blocks == 0 and c.compute_tokens == tokens

    failed = Router("kv_aware", BS)
    for _ in range(60):
        failed.cost.observe(
            ttft_s=2.2, computed_tokens=tokens, pulled_blocks=0, queue_len=0,
            pull_s=2.0, read_blocks=64, block_size=BS,
        )  # fmt: skip
    assert failed.cost.t_token_s == pytest.approx(0.2 / tokens, rel=0.01)
    per_block = (2.0 + 64 * BS * 0.2 / tokens) / 64
    assert failed.cost.t_pull_block_s == pytest.approx(per_block, rel=0.01)
    c = failed.choose(["a", "b"], views, tokens)
    assert c.worker == "a" and c.pull_blocks == 0 and c.compute_tokens == tokens


def report(samples: int = 5, **costs: float) -> dict:
    """A worker's routing stats: the costs it measured, each on ``samples`` samples."""
    keys = {"t_token_s": "token", "t_pull_block_s": "pull", "t_disk_block_s": "disk"}
    links = costs.pop("pull_links", {})
    return {**costs, "samples": {keys[k]: samples for k in costs}, "pull_links": links}


def test_each_worker_is_charged_its_own_measured_costs() -> None:
    """A worker on a faster device computes for less, one with a slower disk loads for more,
    and a worker that measured nothing yet is charged the others' mean. (The router charged
    every worker the mean, so equal prompts tied and went by name.)"""
    r = Router("kv_aware", BS)
    r.learn({"a": report(t_token_s=4e-3), "b": report(t_token_s=1e-3), "c": report()})
    assert r.cost_of("c").t_token_s == pytest.approx(2.5e-3)
    assert r.cost_of("unknown").t_token_s == pytest.approx(2.5e-3)
    tokens = 64 * BS + 5
    c = r.choose(["a", "b", "c"], {}, tokens)
    assert c.worker == "b" and c.estimated_ttft_s == pytest.approx(tokens * 1e-3)
    # Both hold the prompt on disk; b's disk is the slow one, so a computes less overall.
    r.learn(
        {
            "a": report(t_token_s=1e-3, t_disk_block_s=1e-3),
            "b": report(t_token_s=1e-3, t_disk_block_s=50e-3),
        }
    )
    on_disk = {w: WorkerView(disk_depth=64) for w in "ab"}
    assert r.choose(["a", "b"], on_disk, tokens).worker == "a"
    # A worker's report that lacks a cost keeps the mean for it, not the prior.
    r.learn({"a": report(t_token_s=1e-3), "b": report(t_pull_block_s=7e-3)})
    assert r.cost_of("a").t_pull_block_s == pytest.approx(7e-3)
    assert r.cost_of("b").t_token_s == pytest.approx(1e-3)
    # A report that counts samples of a cost it does not carry (another version's replica)
    # is taken as no sample, never a failed decision.
    r.learn({"a": {"samples": {"token": 3}}, "b": report(t_token_s=2e-3)})
    assert r.cost_of("a").t_token_s == pytest.approx(2e-3)


def test_a_pull_is_charged_its_links_cost_and_comes_from_the_nearest_holder() -> None:
    """h1 and h2 (busy) hold the prompt; a reaches h1 over a fast link (its own host) and h2
    over a slow one, b only over slow links. a pulls, from h1, though h2 wins by name."""
    cost = CostModel()
    for _ in range(5):
        cost.observe(0.05, 5, 64, 0, pull_s=0.02, read_from="h1")
        cost.observe(0.5, 5, 64, 0, pull_s=0.5, read_from="h2")
        cost.observe(0.5, 5, 64, 0, pull_s=0.5)  # reads from several peers: no link's
    assert cost.pull_links == pytest.approx({"h1": 0.02 / 64, "h2": 0.5 / 64})
    assert cost.link_samples == {"h1": 5, "h2": 5} and cost.samples["pull"] == 15

    r = Router("kv_aware", BS)
    slow = 0.5 / 64
    r.learn(
        {
            "a": report(t_token_s=1e-3, t_pull_block_s=slow, pull_links=cost.pull_links),
            "b": report(t_token_s=1e-3, t_pull_block_s=slow),
        }
    )
    tokens = 64 * BS + 5
    views = {h: WorkerView(queue=50, depth=64) for h in ("h1", "h2")}
    c = r.choose(["a", "b", "h1", "h2"], views, tokens)
    assert c.worker == "a" and c.pull_blocks == 64
    assert c.estimated_ttft_s == pytest.approx(0.02 + 5 * 1e-3)
    assert r.pick_holder("a", {"h1": 64, "h2": 64}, {}) == "h1"
    assert r.pick_holder("b", {"h1": 64, "h2": 64}, {}) == "h2"  # no link known: by name
    assert r.pick_holder("a", {"h1": 63, "h2": 64}, {}) == "h2"  # the deeper first
    # The plan's holder agrees, counting only the blocks the prompt can hit.
    info = {"held": {"h1": 64, "h2": 80}}
    assert _holder(info, "a", r, 64) == "h1"
    assert _holder(info, "b", r, 64) == "h2"


def test_a_migration_is_not_routed_back_to_the_worker_it_was_lost_on() -> None:
    """Serve lists a hung replica until its health checks fail; a request lost there (its
    call went silent) goes elsewhere, unless no other replica is left."""
    replicas = [
        SimpleNamespace(replica_id=SimpleNamespace(unique_id=u)) for u in ("aaa", "bbb", "ccc")
    ]

    def ids(request: WorkerRequest | None, candidates: list = replicas) -> list[str]:
        return [r.replica_id.unique_id for r in not_lost_on(candidates, request)]

    fresh = WorkerRequest("r", [1, 2], SamplingParams())
    moved = dataclasses.replace(fresh, lost_on=(worker_name("worker", "bbb"),))
    assert ids(None) == ids(fresh) == ["aaa", "bbb", "ccc"]
    assert ids(moved) == ["aaa", "ccc"]
    assert ids(moved, replicas[1:2]) == ["bbb"]  # the only one: better than nowhere


def test_routed_to_names_the_replica_serve_placed_the_request_on() -> None:
    """A router ranks the replicas; Serve takes a later rank when its first choice is full
    and calls ``on_request_routed`` once a replica accepted. ``routed_to`` must then name
    that replica: a call lost before it sent anything is pinned on it, and the ingress
    avoids that worker after. Before, it kept the first choice, so the full, healthy worker
    was avoided and the hung one kept getting requests."""
    for cls in (KvAwareRequestRouter, RoundRobinRequestRouter):
        request = WorkerRequest("r", [1, 2], SamplingParams(), routed_to=worker_name("worker", "a"))
        pending = SimpleNamespace(args=[request], kwargs={})
        router = cls.__new__(cls)  # Serve's constructor wants a live controller; not needed
        router.role = "worker"
        router.on_request_routed(pending, SimpleNamespace(unique_id="b"), None)
        assert request.routed_to == worker_name("worker", "b"), cls.__name__
        router.on_request_routed(SimpleNamespace(args=["not ours"], kwargs={}), None, None)


def test_a_migration_neither_pulls_from_nor_waits_for_the_worker_it_was_lost_on() -> None:
    """A request lost on a hung worker: its plan must not name that worker as the holder to
    pull from, nor a prefix to wait for there. Before, the plan pulled from the hung holder
    (still in the index), and each such pull waited out its pin's timeout in the new
    worker's one load thread, the loads queued behind it too."""
    index = KvIndex("fp")
    hashes = [bytes([i]) * 16 for i in range(6)]
    token = index.register("worker-hung", "fp")
    assert index.apply(encode_batch(EventBatch("worker-hung", 0, (Stored(tuple(hashes)),))), token)
    index.register("worker-b", "fp")
    index.register("worker-c", "fp")
    index.add_pending("worker-hung", hashes, 96)
    info = index.route_lookup(hashes)
    r = Router("kv_aware", BS)
    assert _holder(info, "worker-b", r, 6) == "worker-hung"
    moved = without(info, ("worker-hung",))
    assert _holder(moved, "worker-b", r, 6) is None
    assert all("worker-hung" not in moved[k] for k in ("held", "tiers", "pending", "queued"))
    assert moved["nodes"] == info["nodes"]  # where a worker is stays known
    assert without(info, ()) is info
    # The views the router chooses by: nothing there to pull or wait for.
    views = {w: WorkerView(depth=moved["held"].get(w, 0)) for w in ("worker-b", "worker-c")}
    c = r.choose(["worker-b", "worker-c"], views, 6 * BS + 3)
    assert c.wait_for is None and c.pull_blocks == 0
