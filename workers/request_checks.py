"""What ``LLMEngine.make_request`` checks of a request's numbers before it is queued: that
the prompt, the tokens resumed from another worker and the answer fit the context, and that
the sampling params name tokens of the vocabulary (``logit_bias``, ``allowed_token_ids``,
``bad_words_token_ids``). Each failure is a ValueError naming the field (the API layer
answers it with a 400)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvmesh.workers.sampling_params import SamplingParams


def check_request(
    num_prompt_tokens: int,
    params: SamplingParams,
    resumed_token_ids: Sequence[int],
    *,
    vocab_size: int,
    max_model_len: int,
    eos_token_ids: Collection[int],
) -> list[int]:
    """The resumed tokens as a list, once every check passed."""
    if num_prompt_tokens >= max_model_len:
        raise ValueError(
            f"prompt: {num_prompt_tokens} tokens is longer than the context "
            f"({max_model_len} tokens, one kept for the answer)"
        )
    if any(t >= vocab_size for t, _ in params.logit_bias):
        raise ValueError(f"logit_bias: token ids must be in the vocabulary, [0, {vocab_size})")
    for name, ids in (
        ("allowed_token_ids", params.allowed_token_ids or ()),
        ("bad_words_token_ids", [t for s in params.bad_words_token_ids for t in s]),
    ):
        if any(t >= vocab_size for t in ids):
            raise ValueError(f"{name}: token ids must be in the vocabulary, [0, {vocab_size})")
    allowed = params.allowed_token_ids
    if allowed is not None and params.min_tokens:
        enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        never = {s[0] for s in params.bad_words_token_ids if len(s) == 1}
        if set(allowed) <= enders | never:
            raise ValueError(
                "allowed_token_ids: until min_tokens, EOS, the stop tokens and bad_words ban "
                "every one of them: no token could be chosen"
            )
    resumed = _check_resumed(
        resumed_token_ids, num_prompt_tokens, params, vocab_size, max_model_len, eos_token_ids
    )
    if num_prompt_tokens + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens: the prompt's {num_prompt_tokens} tokens plus max_tokens "
            f"{params.max_tokens} exceed the context of {max_model_len} tokens"
        )
    return resumed


def _check_resumed(
    resumed_token_ids: Sequence[int],
    num_prompt_tokens: int,
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    eos_token_ids: Collection[int],
) -> list[int]:
    """The resumed tokens as a list, or ValueError naming ``resumed_token_ids`` when no
    unbroken run could have streamed them and still be running."""
    resumed = list(resumed_token_ids)
    if not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in resumed
    ):
        raise ValueError(f"resumed_token_ids: token ids must be integers in [0, {vocab_size})")
    if len(resumed) >= params.max_tokens:
        raise ValueError(
            f"resumed_token_ids: {len(resumed)} tokens leave nothing to generate under "
            f"max_tokens {params.max_tokens}"
        )
    if num_prompt_tokens + len(resumed) >= max_model_len:
        raise ValueError(
            f"resumed_token_ids: the prompt's {num_prompt_tokens} tokens plus "
            f"{len(resumed)} resumed tokens leave no room in the context of "
            f"{max_model_len} tokens"
        )
    enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if enders.intersection(resumed):
        raise ValueError(
            "resumed_token_ids: they hold a stop or EOS token, so the request has already finished"
        )
    return resumed
