"""What the HTTP API and the Python handle need from the serving layer: the ``Backend`` contract.

The OpenAI routes (``openai_api.py``) turn HTTP bodies into ``GenerateRequest``s and
``Completion`` / ``Chunk`` objects back into OpenAI JSON; the cluster frontend implements
``Backend`` over Ray worker actors and the router; ``LocalBackend`` implements it over one
in-process engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from kvmesh.workers.outputs import RequestOutput
from kvmesh.workers.sampling_params import SamplingParams


class Unavailable(RuntimeError):
    """The serving layer cannot finish this request now (e.g. its worker was lost more often
    than ``max_migrations`` allows): HTTP 503 with this message, which names the cause."""


@dataclass(frozen=True)
class GenerateRequest:
    """One request, already validated field by field; exactly one of prompt / messages."""

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # The prompt's token ids when the caller already tokenized it (the HTTP layer does, to
    # check the length): a backend uses them instead of tokenizing again.
    prompt_ids: list[int] | None = None


@dataclass
class KvSource:
    """Where the prompt's KV came from: the ``kvmesh`` object of every response."""

    worker: str
    local_hit_tokens: int  # hit in the worker's pool
    pulled_tokens: int  # pulled from a peer's pool
    computed_tokens: int
    ttft_ms: float | None
    prefill_worker: str | None = None
    migrations: int = 0  # times the request moved to another worker after losing one
    host_hit_tokens: int = 0  # loaded from the worker's host-memory tier
    disk_hit_tokens: int = 0  # loaded from the worker's disk tier

    @classmethod
    def of(cls, worker: str, out: RequestOutput, prefill_worker: str | None = None) -> KvSource:
        m = out.metrics
        ttft = None if m.ttft_s is None else round(m.ttft_s * 1000, 2)
        return cls(
            worker,
            m.num_local_hit_tokens,
            m.num_pulled_tokens,
            m.num_computed_tokens,
            ttft,
            prefill_worker,
            host_hit_tokens=m.num_host_hit_tokens,
            disk_hit_tokens=m.num_disk_hit_tokens,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["prefill_worker"] is None:
            del d["prefill_worker"]
        return d


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str
    kv: KvSource
    # With SamplingParams.logprobs: per generated token, {token id: logprob} of the sampled
    # token and the top N.
    logprobs: list[dict[int, float]] | None = None
    # With SamplingParams.prompt_logprobs: per prompt token, its entry (None for the first).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # The worker's time from the first token to the last: what a whole (not streamed)
    # response waited for after its first token, taken off to get the ingress's TTFT.
    decode_s: float = 0.0

    @classmethod
    def of(
        cls, request_id: str, worker: str, out: RequestOutput, prefill_worker: str | None = None
    ) -> Completion:
        """A finished engine output, served by ``worker`` (after ``prefill_worker``)."""
        m = out.metrics
        decode_s = 0.0
        if m.first_token_time is not None and m.finished_time is not None:
            decode_s = max(0.0, m.finished_time - m.first_token_time)
        return cls(
            request_id=request_id,
            text=out.text,
            token_ids=list(out.token_ids),
            prompt_token_ids=list(out.prompt_token_ids),
            finish_reason=out.finish_reason or "stop",
            kv=KvSource.of(worker, out, prefill_worker),
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            decode_s=decode_s,
        )

    @property
    def cached_tokens(self) -> int:
        """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: every prompt token not
        computed (hits in the pool and the tiers, and pulled)."""
        kv = self.kv
        return kv.local_hit_tokens + kv.host_hit_tokens + kv.disk_hit_tokens + kv.pulled_tokens


@dataclass
class Chunk:
    """A streamed piece; the last one has ``finish_reason`` and the whole ``completion``."""

    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    completion: Completion | None = None
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, when asked for
    # With SamplingParams.prompt_logprobs, on the request's first chunk that has tokens.
    prompt_logprobs: list[dict[int, float] | None] | None = None


class Backend(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a completion prompt (ValueError naming ``prompt`` on bad input)."""

    def tokenize_chat(self, messages: list[dict[str, Any]], **template: Any) -> list[int]:
        """Token ids of the chat template applied to ``messages`` plus the assistant turn;
        ``template``: ``chat_prompt_ids``'s ``add_generation_prompt``,
        ``continue_final_message`` and ``tools``."""

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs)."""

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """Each token's raw bytes (for logprobs: part of a character where a token holds
        only part of one)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` as generated text decodes them (for logprobs' text offsets;
        ``/detokenize`` keeps special tokens)."""

    def bad_words_token_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """vLLM's ``bad_words`` as the token id sequences the workers ban
        (``workers/bad_words.py``; ValueError naming ``bad_words``)."""

    async def generate(self, request: GenerateRequest) -> Completion: ...

    def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]: ...

    async def stats(self) -> dict[str, Any]:
        """Gauges for /metrics: per-worker running/waiting, index blocks, pull counters."""
