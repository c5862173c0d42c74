"""Batched sampling: greedy, temperature, min-p, top-k, top-p, with randomness keyed by position.

The random draw for a request's output token number ``i`` (``i`` output tokens before it) comes
from a generator seeded with ``position_seed(seed, i)``: a function of the request's seed and
``i`` alone. Neither the batch nor what the request drew before changes it, so a request cut
off on one worker and resumed on another (or preempted and recomputed) draws the same tokens
as the unbroken run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from kvmesh.workers.sampling_params import SamplingParams


def position_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed for output position ``position`` of a request seeded ``seed``.

    xxh3-64 of canonical bytes (decimal text, so any Python int works): the same on every
    process and machine, unlike Python's ``hash()``. 63 bits fit every ``manual_seed``.
    """
    return xxhash.xxh3_64_intdigest(b"kvmesh-sample:%d:%d" % (seed, position)) >> 1


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """One token per row of ``logits`` [B, V] (float32).

    Greedy rows take the argmax. Other rows are scaled by temperature, filtered by min-p, then
    top-k and top-p (vLLM's order), and sampled by inverting their cumulative distribution at
    one uniform draw. Row ``r``'s draw comes from a fresh generator seeded with
    ``position_seed(seeds[r], positions[r])`` (``positions[r]``: the row's count of output
    tokens so far), so a seeded request draws the same token at the same position in any
    batch, on any worker.
    """
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        sub = logits if len(rows) == len(params) else logits.index_select(0, idx)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        sub = sub / temps.unsqueeze(1)
        sub = _min_p(sub, [params[i].min_p for i in rows])
        sub = _top_k_top_p(
            sub,
            [params[i].top_k for i in rows],
            torch.tensor([params[i].top_p for i in rows], device=logits.device),
        )
        probs = sub.softmax(dim=-1)
        # One uniform a row (the exponential race, argmax p / Exp(1), needs a draw per token
        # of the vocabulary: ~1 ms a row on a CPU). Drawn on the CPU so it is the same
        # whatever device the model runs on; a generator per row costs a few microseconds.
        uniform = torch.tensor(
            [
                torch.rand(
                    1,
                    dtype=torch.float64,
                    generator=torch.Generator().manual_seed(position_seed(seeds[i], positions[i])),
                ).item()
                for i in rows
            ],
            dtype=torch.float64,
        ).to(probs.device)
        out[idx] = _invert_cdf(probs, uniform)
    return out.tolist()


def _invert_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Row r's token: the first whose cumulative mass exceeds uniform[r] times the row's total.

    A token of mass 0 (masked by top-k or top-p) adds exactly 0 to the sum, so it is never the
    first to exceed. Summed in float32 (float64 cumsum is ten times slower on a CPU): rounding
    moves a boundary by ~1e-7 of the mass for each 1,000 tokens before it, far below what a
    sample could show.
    """
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u * total can round up to the total itself, which no entry exceeds: stay below it.
    target = torch.minimum(
        uniform.to(probs.dtype).unsqueeze(1) * total, total.nextafter(total.new_zeros(()))
    )
    picked = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # NaN logits (a model that overflowed) sort past every entry: still answer a real token.
    return picked.clamp_(max=probs.shape[-1] - 1)


def _min_p(logits: torch.Tensor, min_ps: Sequence[float]) -> torch.Tensor:
    """Mask (to -inf) the tokens less likely than min_p times the likeliest one (vLLM's
    min_p). In logits, with no softmax: p_t < min_p * p_max exactly when
    l_t < l_max + log(min_p); a min_p of 0 (log -inf) keeps every token."""
    if not any(min_ps):
        return logits
    log_min_p = torch.tensor(min_ps, dtype=logits.dtype, device=logits.device).log()
    threshold = logits.max(dim=-1, keepdim=True).values + log_min_p.unsqueeze(1)
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_k_top_p(
    logits: torch.Tensor, top_ks: Sequence[int | None], top_ps: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p leave out; both act on the sorted logits."""
    if all(k is None for k in top_ks) and bool((top_ps >= 1).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([min(k, vocab) if k else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token once the mass
    # *before* it already reaches top_p (the first token is always kept).
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_ps.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
