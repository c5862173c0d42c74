"""A stream's deltas merged to at most one message per interval (``Worker.stream``'s
``interval_s``, the Serve app's ``stream_interval_s``): the same tokens, text and logprobs
in fewer pieces, the first one not held back. And its keep-alives (``keepalive_s``): empty
deltas while the request has nothing to send, none without it."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator

import pytest

from kvmesh.workers.engine_config import EngineConfig
from kvmesh.workers.outputs import RequestMetrics, RequestOutput, StreamDelta
from kvmesh.workers.sampling_params import SamplingParams
from kvmesh.workers.worker import Worker

PROMPT = "Once upon a time"
PARAMS = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    config = EngineConfig(model="tiny-random", block_size=4, num_kv_blocks=64, progress=False)
    w = Worker("w", config)
    yield w
    w.shutdown()


def timed(stream: Iterator[StreamDelta]) -> list[tuple[float, StreamDelta]]:
    return [(time.monotonic(), d) for d in stream]


def test_merged_keeps_order_and_takes_the_later_finish() -> None:
    out = RequestOutput("r", [1], [5, 6], "ab", "length", RequestMetrics(0.0))
    a = StreamDelta("r", [5], "a", logprobs=[{5: -0.1}], worker="w1")
    b = StreamDelta("r", [6], "b", "length", out, logprobs=[{6: -0.2}])
    m = a.merged(b)
    assert (m.token_ids, m.text, m.logprobs) == ([5, 6], "ab", [{5: -0.1}, {6: -0.2}])
    assert (m.finish_reason, m.output, m.worker) == ("length", out, "w1")
    assert StreamDelta("r", [1], "x").merged(StreamDelta("r", [2], "y")).logprobs is None


def cold(worker: Worker) -> Worker:
    """The worker with its prefix cache emptied. A second run of a prompt would hit its cached
    blocks and compute only the last one's tokens, through the attention kernel rather than
    SDPA: the same greedy tokens, but logprobs that may differ in their last bits."""
    assert worker.call(worker.kv.reset_prefix_cache)
    return worker


def test_an_interval_merges_deltas_and_loses_nothing(worker: Worker) -> None:
    every = timed(cold(worker).stream(PROMPT, PARAMS))
    interval = 0.05
    merged = timed(cold(worker).stream(PROMPT, PARAMS, interval_s=interval))
    # Without an interval a message goes per token, unless tokens piled up meanwhile.
    assert len(every) > PARAMS.max_tokens * 0.8
    joined = [d for _, d in merged]
    assert [t for d in joined for t in d.token_ids] == [t for _, d in every for t in d.token_ids]
    assert "".join(d.text for d in joined) == "".join(d.text for _, d in every)
    assert [lp for d in joined for lp in d.logprobs or []] == [
        lp for _, d in every for lp in d.logprobs or []
    ]
    assert joined[-1].output is not None and joined[-1].finish_reason == "length"
    assert all(d.finish_reason is None for d in joined[:-1])
    # Fewer messages, never two within one interval (tiny-random makes a token in ~ms).
    assert len(merged) < PARAMS.max_tokens / 2, [len(d.token_ids) for d in joined]
    # The last goes when the request finishes, so only the ones before it are spaced.
    times = [t for t, _ in merged[:-1]]
    assert all(b - a >= interval * 0.95 for a, b in itertools.pairwise(times))


def test_the_first_delta_is_not_held_back(worker: Worker) -> None:
    interval = 0.5
    start = time.monotonic()
    merged = timed(worker.stream(PROMPT, PARAMS, interval_s=interval))
    times = [t for t, _ in merged]
    assert times[0] - start < interval / 2  # TTFT: the first message goes at once
    # The next waits for the interval, unless it is the last (the request finished).
    assert merged[1][1].finish_reason is not None or times[1] - times[0] >= interval * 0.95
    assert sum(len(d.token_ids) for _, d in merged) == PARAMS.max_tokens


def test_the_last_delta_is_not_held_back(worker: Worker) -> None:
    """A request that finishes within the interval ends then, not at the interval's end
    (before: its last delta waited out the interval; an answer sent whole, whose interval is a
    second, took up to a second longer than its tokens)."""
    interval = 30.0
    start = time.monotonic()
    merged = timed(worker.stream(PROMPT, SamplingParams(max_tokens=20), interval_s=interval))
    assert merged[-1][1].finish_reason is not None
    assert merged[-1][0] - start < interval / 3, merged[-1][0] - start


def test_a_stream_closed_early_frees_its_request(worker: Worker) -> None:
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    stream = worker.stream(PROMPT, params, interval_s=0.05)
    assert next(stream).token_ids
    stream.close()
    deadline = time.monotonic() + 5
    while worker.call(worker.engine.has_unfinished) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.call(worker.engine.has_unfinished)


@pytest.mark.parametrize("value", [-0.01, 1.5, float("nan")])
def test_a_bad_stream_interval_is_refused_with_its_name(value: float) -> None:
    from kvmesh.cluster.config import ServeConfig

    with pytest.raises(ValueError, match="stream_interval_s"):
        ServeConfig(stream_interval_s=value)


KEEP_PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def test_an_engine_held_up_sends_keep_alives_and_loses_nothing(worker: Worker) -> None:
    """The step thread held for 0.6 s mid-request (a long step, a slow load): the stream's
    keep-alives go on every 0.1 s, and the request's tokens are those of a run without."""
    reference = [t for d in worker.stream(PROMPT, KEEP_PARAMS) for t in d.token_ids]
    stream = worker.stream(PROMPT, KEEP_PARAMS, keepalive_s=0.1)
    out = [next(stream)]
    hold = threading.Thread(target=worker.call, args=(lambda: time.sleep(0.6),))
    hold.start()
    out += list(stream)
    hold.join()
    assert [t for d in out for t in d.token_ids] == reference
    beats = [d for d in out if d.is_empty]
    assert 3 <= len(beats) <= 7, len(beats)
    assert out[-1].output is not None
    # Held before the request is even queued (the step thread takes it between two steps,
    # and a step may be long): keep-alives while it waits for its place too.
    hold = threading.Thread(target=worker.call, args=(lambda: time.sleep(0.5),))
    hold.start()
    time.sleep(0.05)
    early = list(worker.stream(PROMPT, KEEP_PARAMS, keepalive_s=0.1))
    hold.join()
    assert [t for d in early for t in d.token_ids] == reference
    assert all(d.is_empty for d in early[:3]), early[:3]
    # Without ``keepalive_s`` (a local caller) the stream sends none.
    plain = list(worker.stream(PROMPT, KEEP_PARAMS))
    assert not any(d.is_empty for d in plain)
