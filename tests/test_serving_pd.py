"""Prefill/decode on the Serve app (real Ray): P/D equals unified, and a lost prefill
replica costs no request."""

from __future__ import annotations

import re

import pytest

from kvmesh import LLM, SamplingParams
from tests.ray_fixtures import ray_session  # noqa: F401
from tests.serve_helpers import (
    check_prompt_logprobs,
    kill_worker,
    redeploy,
    replica_log,
    running_replicas,
    tiny_config,
    tiny_reference,
    undeploy,
    wait_for,
)

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def reference() -> LLM:
    return tiny_reference()


def test_prefill_decode_equals_unified_and_survives_prefill_death(reference) -> None:
    """P/D equals unified; while the only prefill replica is lost and its replacement starts,
    prompts are computed by the decode worker at once instead of queueing for the new one;
    once it runs, prefill moves back to it."""
    handle = redeploy(tiny_config(prefill_workers=1, decode_workers=1, prefill_wait_s=0.5))
    try:
        ids = list(range(3, 70))
        req = {"prompt": ids, "max_tokens": 8, "temperature": 0}
        out = handle.generate.remote(req).result()
        want = reference.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0]
        assert out["token_ids"] == want.token_ids
        kv = out["kvmesh"]
        assert kv["prefill_worker"].startswith("prefill-")
        assert kv["worker"].startswith("decode-")
        assert kv["pulled_tokens"] == (len(ids) - 1) // 4 * 4  # only the last block recomputed
        # A salted request: both sides hash its blocks in its salt's namespace, so the decode
        # worker pulls what the prefill worker computed (the unsalted blocks are not its).
        salted = handle.generate.remote({**req, "cache_salt": "s"}).result()
        assert salted["token_ids"] == want.token_ids
        assert salted["kvmesh"]["pulled_tokens"] == kv["pulled_tokens"], salted["kvmesh"]
        assert salted["kvmesh"]["prefill_worker"] == kv["prefill_worker"]
        # min_tokens past the prefill's one token, and a structured output: the prefill
        # request leaves out what only decoding reads (min_tokens made it a ValueError, so
        # the decode worker computed every such prompt itself).
        shaped = {"max_tokens": 8, "temperature": 0, "min_tokens": 4}
        shaped["structured_outputs"] = {"regex": "[a-z]{6}"}
        out_s = handle.generate.remote({"prompt": ids[:-5], **shaped}).result()
        assert out_s["kvmesh"].get("prefill_worker") == kv["prefill_worker"], out_s["kvmesh"]
        want_s = reference.generate([ids[:-5]], SamplingParams(**shaped))[0]
        assert out_s["text"] == want_s.text and re.fullmatch("[a-z]{6}", want_s.text)

        kill_worker(kv["prefill_worker"])
        # Serve has noticed the loss and starts a replacement: no prefill replica runs.
        wait_for(lambda: running_replicas("prefill") == 0, 30, "the prefill replica's loss")
        ids2 = list(range(5, 60))
        out2 = handle.generate.remote({**req, "prompt": ids2}).result()
        want2 = reference.generate([ids2], SamplingParams(max_tokens=8, temperature=0))[0]
        assert out2["token_ids"] == want2.token_ids
        kv2 = out2["kvmesh"]
        assert "prefill_worker" not in kv2  # it did not wait for the replacement
        assert kv2["computed_tokens"] == len(ids2)
        # The ingress says so where an operator reads Serve's logs, with the request's id.
        line = [ln for ln in replica_log("KvmeshServer").splitlines() if "decode computes" in ln]
        assert line and "WARNING" in line[-1], replica_log("KvmeshServer")[-2000:]

        wait_for(lambda: running_replicas("prefill") == 1, 60, "the replacement prefill replica")

        def prefilled_again() -> str | None:
            ids3 = list(range(7, 50))
            out3 = handle.generate.remote({**req, "prompt": ids3}).result()
            return out3["kvmesh"].get("prefill_worker")

        again = wait_for(prefilled_again, 30, "a prefill on the replacement", every=0.5)
        assert again != kv["prefill_worker"]
        # Prompt logprobs need the prompt computed where it decodes: no prefill replica.
        kv4 = check_prompt_logprobs(handle, reference, "tiny-random")
        assert "prefill_worker" not in kv4 and kv4["worker"].startswith("decode-")
    finally:
        undeploy()
