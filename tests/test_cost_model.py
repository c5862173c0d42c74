"""The measured cost model a worker keeps (no Ray): what a finished request teaches, tier
loads and promotions, per-peer link costs."""

import pytest

from kvmesh.cluster.cost_model import MAX_LINKS, PRIOR_T_TOKEN_S, CostModel, worker_costs
from kvmesh.workers.outputs import RequestMetrics

BS = 16


def test_cost_model_learns_from_observations() -> None:
    cost = CostModel()
    for _ in range(50):
        cost.observe(ttft_s=1.0, computed_tokens=1000, pulled_blocks=0, queue_len=0)
    assert cost.t_token_s == pytest.approx(1e-3, rel=1e-3)
    for _ in range(50):
        cost.observe(ttft_s=0.02, computed_tokens=0, pulled_blocks=100, queue_len=0, pull_s=0.01)
    assert cost.t_pull_block_s == pytest.approx(1e-4, rel=1e-3)
    # Waiting behind 1000 prompt tokens already routed there is not this request's own cost.
    for _ in range(50):
        cost.observe(
            ttft_s=2.0, computed_tokens=1000, pulled_blocks=0, queue_len=0, backlog_tokens=1000
        )
    assert cost.t_token_s == pytest.approx(1e-3, rel=1e-3)
    assert cost.samples["token"] == 100 and cost.samples["pull"] == 50
    # The worker measured the wait for a free sequence slot: it is the queue's, not the
    # prompt's (100 tokens computed after 0.4 s in line would teach 5 ms a token).
    for _ in range(50):
        cost.observe(ttft_s=0.5, computed_tokens=100, pulled_blocks=0, queue_len=2, queue_s=0.4)
    assert cost.t_token_s == pytest.approx(1e-3, rel=1e-3)
    assert cost.t_queue_s == pytest.approx(0.2, rel=1e-3)
    # A few tokens in a step measure the step, not the tokens: no sample.
    cost.observe(ttft_s=0.01, computed_tokens=10, pulled_blocks=0, queue_len=0)
    assert cost.t_token_s == pytest.approx(1e-3, rel=1e-3) and cost.samples["token"] == 150


def test_a_request_learns_pull_costs_from_its_own_reads_only() -> None:
    """``observe_request``: the request that read teaches the pull's cost; one that hit the
    blocks another request pulled teaches none (it was charged the other's read as a failed
    one: 32 ms a block at the prior's 2 ms a token, a link ten times slower than it was); a
    read that failed teaches its wait plus computing its blocks."""
    cost = CostModel()
    reader = RequestMetrics(0.0, first_scheduled_time=0.0, first_token_time=0.105)
    reader.num_pulled_tokens, reader.num_computed_tokens = 64 * BS, 5
    reader.num_read_blocks, reader.read_s = 64, 0.1
    cost.observe_request(reader, 0, BS)
    assert cost.samples["pull"] == 1 and cost.t_pull_block_s == pytest.approx(0.1 / 64)
    hitter = RequestMetrics(0.0, first_scheduled_time=0.1, first_token_time=0.11)
    hitter.num_local_hit_tokens, hitter.num_computed_tokens = 64 * BS, 5
    cost.observe_request(hitter, 0, BS)
    assert cost.samples["pull"] == 1 and cost.t_pull_block_s == pytest.approx(0.1 / 64)
    failed = RequestMetrics(0.0, first_scheduled_time=0.0, first_token_time=2.5)
    failed.num_computed_tokens, failed.num_read_blocks, failed.read_s = 64 * BS + 5, 64, 2.0
    cost.observe_request(failed, 0, BS)
    assert cost.samples["pull"] == 2
    spent = (2.0 + 64 * BS * PRIOR_T_TOKEN_S) / 64  # t_token_s was not learned yet
    assert cost.t_pull_block_s == pytest.approx((0.1 / 64 + spent) / 2, rel=1e-3)
    unfinished = RequestMetrics(0.0)  # aborted before its first token: no sample
    cost.observe_request(unfinished, 0, BS)
    assert cost.samples == {"token": 1, "pull": 2, "queue": 0, "host": 0, "disk": 0}


def test_cost_model_learns_tier_costs() -> None:
    m = CostModel()
    m.observe(0.5, 100, 0, 0, tier=(0, 50, 0.1))
    assert m.t_disk_block_s == pytest.approx(0.002) and m.samples["disk"] == 1
    assert m.t_token_s == pytest.approx(0.4 / 100)  # the load's time is not the prompt's
    m.observe(0.1, 0, 0, 0, tier=(100, 0, 0.01))
    assert m.t_host_block_s == pytest.approx(1e-4) and m.samples["host"] == 1


def test_a_mixed_tier_load_teaches_the_disk_its_own_share() -> None:
    """100 host blocks (1e-4 s each, learned) and 10 disk blocks loaded in 0.05 s: the disk
    learns (0.05 - 0.01) / 10 = 4 ms a block. Before, 0.05 / 110 (0.45 ms): the router took
    the disk for nearly as fast as memory. The host learns nothing from a mixed load."""
    m = CostModel(t_host_block_s=1e-4, samples={**CostModel().samples, "host": 5})
    tokens = {"num_host_hit_tokens": 100 * BS, "num_disk_hit_tokens": 10 * BS}
    loaded = RequestMetrics(0.0, first_scheduled_time=0.0, first_token_time=0.06, **tokens)
    loaded.kv_load_s = 0.05
    m.observe_request(loaded, 0, BS)
    assert m.t_disk_block_s == pytest.approx(4e-3) and m.samples["disk"] == 1
    assert m.t_host_block_s == 1e-4 and m.samples["host"] == 5
    # A load faster than the host blocks' learned cost: the disk still gets an even share.
    m.observe_tier_load(10, 10, 0.001)
    assert m.t_disk_block_s == pytest.approx((4e-3 + 5e-5) / 2)  # the mean of two samples


def test_a_holders_promotions_teach_its_host_block_cost() -> None:
    cost = CostModel()
    cost.observe_tier("host", 126, 0.16)
    assert cost.t_host_block_s == pytest.approx(0.16 / 126) and cost.samples["host"] == 1
    cost.observe_tier("host", 0, 1.0)  # nothing copied: no sample
    assert cost.samples["host"] == 1


def test_link_costs_keep_the_most_recent_peers() -> None:
    cost = CostModel()
    for i in range(MAX_LINKS + 10):
        cost.observe(0.1, 5, 4, 0, pull_s=0.01, read_from=f"w{i}")
    assert "w9" not in cost.pull_links and "w10" in cost.pull_links  # the oldest went
    cost.observe(0.1, 5, 4, 0, pull_s=0.01, read_from="w10")  # used again: now the newest
    cost.observe(0.1, 5, 4, 0, pull_s=0.01, read_from="new")
    assert len(cost.pull_links) == len(cost.link_samples) == MAX_LINKS
    assert "w10" in cost.pull_links and "w11" not in cost.pull_links
    assert cost.link_samples["w10"] == 2


def test_a_workers_report_reads_back_as_its_costs() -> None:
    """``report`` (what a replica sends with its routing stats) and ``worker_costs`` (what the
    router reads) agree on every cost, its samples and the links."""
    cost = CostModel()
    cost.observe(0.2, 100, 4, 0, pull_s=0.04, read_from="peer")
    cost.observe_tier("disk", 10, 0.05)
    (back,) = worker_costs({"w": cost.report()}, CostModel()).values()
    assert back == CostModel(**{**vars(cost), "link_samples": {}})
