"""The router's choices and its measured cost model (no Ray)."""

import pytest

from kvmesh.cluster.router import CostModel, Router


def test_baselines() -> None:
    rr = Router("round_robin", 16)
    assert [rr.choose(["a", "b", "c"], {}).worker for _ in range(4)] == ["a", "b", "c", "a"]
    ll = Router("least_loaded", 16)
    assert ll.choose(["a", "b", "c"], {"a": 3, "b": 1, "c": 2}).worker == "b"
    with pytest.raises(ValueError, match="policy"):
        Router("random", 16)
    with pytest.raises(RuntimeError, match="no worker"):
        rr.choose([], {})


def test_kv_aware_prefers_the_holder_until_its_queue_costs_more() -> None:
    r = Router("kv_aware", 16)
    tokens = 64 * 16 + 5
    assert r.choose(["a", "b"], {}, tokens, {"b": 64}).worker == "b"
    # b holds everything, a can pull it: with b busy enough, pulling on a wins.
    c = r.choose(["a", "b"], {"b": 50}, tokens, {"b": 64})
    assert c.worker == "a" and c.pull_blocks == 64
    # Without the connector nothing can be pulled: computing on a costs the whole prompt.
    local_only = Router("kv_aware", 16, connector=False)
    assert local_only.choose(["a", "b"], {"b": 5}, tokens, {"b": 64}).worker == "b"


def test_pending_prefix_is_local_but_not_pullable() -> None:
    r = Router("kv_aware", 16)
    tokens = 40 * 16 + 3
    c = r.choose(["a", "b"], {"a": 1}, tokens, depths={}, pending={"a": 40})
    assert c.worker == "a" and c.local_blocks == 40 and c.pull_blocks == 0
    other = r.choose(["b"], {}, tokens, depths={}, pending={"a": 40})
    assert other.pull_blocks == 0  # a only computes them: nothing to pull yet


def test_cost_model_learns_from_observations() -> None:
    cost = CostModel()
    for _ in range(50):
        cost.observe(ttft_s=1.0, computed_tokens=1000, pulled_blocks=0, queue_len=0)
    assert cost.t_token_s == pytest.approx(1e-3, rel=1e-3)
    for _ in range(50):
        cost.observe(ttft_s=0.02, computed_tokens=0, pulled_blocks=100, queue_len=0, pull_s=0.01)
    assert cost.t_pull_block_s == pytest.approx(1e-4, rel=1e-3)
    assert cost.samples["token"] == 50 and cost.samples["pull"] == 50
