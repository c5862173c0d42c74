"""The sampler draws from the distribution it is given: frequencies against the softmax,
min-p / top-k / top-p masks, and the cumulative distribution's edges."""

from __future__ import annotations

import torch

from kvmesh.workers.sampler import _invert_cdf, sample
from kvmesh.workers.sampling_params import SamplingParams

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
DRAWS = 20_000


def frequencies(params: SamplingParams, seed: int = 3) -> torch.Tensor:
    rows = sample(LOGITS.expand(DRAWS, -1), [params] * DRAWS, [seed] * DRAWS, list(range(DRAWS)))
    return torch.bincount(torch.tensor(rows), minlength=len(LOGITS)).double() / DRAWS


def chi_square(freq: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    return float((DRAWS * (freq[keep] - probs[keep]) ** 2 / probs[keep]).sum())


def test_draws_follow_the_tempered_softmax() -> None:
    for temperature in (1.0, 0.5, 1.7):
        probs = (LOGITS.double() / temperature).softmax(-1)
        freq = frequencies(SamplingParams(temperature=temperature))
        # 5 degrees of freedom: 40 is beyond the 1 - 1e-7 quantile; a biased draw (e.g. an
        # off-by-one at the boundaries) lands in the hundreds.
        assert chi_square(freq, probs) < 40, (temperature, freq, probs)


def test_top_k_and_top_p_draw_only_what_they_keep() -> None:
    freq = frequencies(SamplingParams(temperature=1.0, top_k=2))
    assert freq[2:].sum() == 0
    kept = torch.cat([LOGITS[:2].double().softmax(-1), torch.zeros(4, dtype=torch.float64)])
    assert chi_square(freq, kept) < 40
    # The two best hold 0.56 + 0.21 of the mass: top_p 0.7 keeps exactly them.
    freq = frequencies(SamplingParams(temperature=1.0, top_p=0.7))
    assert freq[2:].sum() == 0 and freq[1] > 0


def test_min_p_draws_only_what_it_keeps() -> None:
    # p = softmax(LOGITS) = 0.56, 0.21, 0.12, 0.08, 0.03, 0.004: min_p 0.2 keeps those at
    # least 0.2 * 0.56 = 0.11 (the first three), in proportion; with temperature 2 (applied
    # first, as vLLM does) the distribution flattens and it keeps five.
    freq = frequencies(SamplingParams(temperature=1.0, min_p=0.2))
    assert freq[3:].sum() == 0
    kept = torch.cat([LOGITS[:3].double().softmax(-1), torch.zeros(3, dtype=torch.float64)])
    assert chi_square(freq, kept) < 40
    freq = frequencies(SamplingParams(temperature=2.0, min_p=0.2))
    assert freq[5] == 0 and bool((freq[:5] > 0).all())
    # With top_k on top, both masks hold.
    freq = frequencies(SamplingParams(temperature=1.0, min_p=0.2, top_k=2))
    assert freq[2:].sum() == 0 and freq[1] > 0
    # min_p 1 keeps only the likeliest; 0 keeps all (the unfiltered softmax).
    assert frequencies(SamplingParams(temperature=1.0, min_p=1.0))[0] == 1
    probs = LOGITS.double().softmax(-1)
    assert chi_square(frequencies(SamplingParams(temperature=1.0, min_p=0.0)), probs) < 40


def test_the_cdf_edges_pick_tokens_with_mass() -> None:
    probs = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.5, 0.5, 0.0, 0.0]])
    # 0 lands on the first token with mass, 1 (what u * total can round to) on the last.
    assert _invert_cdf(probs, torch.tensor([0.0, 0.0], dtype=torch.float64)).tolist() == [1, 0]
    assert _invert_cdf(probs, torch.tensor([1.0, 1.0], dtype=torch.float64)).tolist() == [2, 1]
    assert _invert_cdf(probs, torch.tensor([0.4, 0.5], dtype=torch.float64)).tolist() == [2, 1]


def test_a_seeded_draw_is_the_same_in_any_batch() -> None:
    p = SamplingParams(temperature=1.0)
    batch = sample(LOGITS.expand(4, -1), [p] * 4, [1, 2, 3, 4], [9, 9, 9, 9])
    assert batch == [sample(LOGITS[None], [p], [s], [9])[0] for s in (1, 2, 3, 4)]


def test_nan_logits_still_give_a_token_of_the_vocabulary() -> None:
    logits = torch.full((2, 6), float("nan"))
    logits[1, 2] = 1.0
    rows = sample(logits, [SamplingParams(temperature=1.0)] * 2, [1, 1], [0, 0])
    assert all(0 <= t < 6 for t in rows), rows
