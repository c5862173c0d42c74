"""Sampling parameters, validated once when a request is made."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop, as in vLLM.

    ``temperature == 0`` is greedy. ``top_k=None`` and ``top_p=1.0`` disable those filters.
    ``seed`` makes one request's sampling reproducible whatever else is in its batch.
    ``stop`` strings are cut from the text; ``stop_token_ids`` end the request like EOS.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # log-probabilities of each sampled token and the top N

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        # Accept lists (and a lone string for stop) the way vLLM users write them.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise bad("max_tokens", "must be an integer")
        if self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, int | float):
            raise bad("temperature", "must be a number")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, int | float):
            raise bad("top_p", "must be a number")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and (
            isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1
        ):
            raise bad("top_k", "must be an integer >= 1 (or None to disable)")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int)
        ):
            raise bad("seed", "must be an integer")
        if self.logprobs is not None and not (
            _is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS
        ):
            raise bad("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}]")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
