"""Batched sampling: greedy, temperature, top-k, top-p, with a generator per request."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.workers.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> list[int]:
    """One token per row of ``logits`` [B, V] (float32).

    Greedy rows take the argmax. Other rows are scaled by temperature, filtered by top-k and
    top-p, and sampled with the exponential-race trick (argmax of p / Exp(1) noise) using the
    row's own generator, so a seeded request draws the same tokens in any batch.
    """
    out = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        idx = torch.tensor(rows, device=logits.device)
        sub = logits.index_select(0, idx)
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        sub = sub / temps.unsqueeze(1)
        sub = _top_k_top_p(
            sub,
            [params[i].top_k for i in rows],
            torch.tensor([params[i].top_p for i in rows], device=logits.device),
        )
        probs = sub.softmax(dim=-1)
        noise = torch.stack(
            [
                torch.empty(probs.shape[1], device="cpu").exponential_(generator=generators[i])
                for i in rows
            ]
        ).to(probs.device)
        out[idx] = (probs / noise).argmax(dim=-1)
    return out.tolist()


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
