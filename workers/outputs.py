"""What a finished (or streaming) request hands back: vLLM's RequestOutput, trimmed."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Where the prompt's KV came from, and how long the first token took.

    ``num_cached_tokens`` were hit in the local prefix cache, ``num_pulled_tokens`` came
    through the connector, ``num_computed_tokens`` were computed: the three add up to the
    prompt length (counted at the request's first scheduling).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_pulled_tokens: int = 0
    num_computed_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop", "length", or None while running
    metrics: RequestMetrics
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    prompt: str | None = None
    # With SamplingParams.logprobs: per generated token, {token id: logprob} for the sampled
    # token and the top N.
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamDelta:
    """One streamed piece of a request's output: the new tokens and the new text."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    output: RequestOutput | None = None  # the full output, set on the last delta
    logprobs: list[dict[int, float]] | None = None  # per token, with SamplingParams.logprobs
