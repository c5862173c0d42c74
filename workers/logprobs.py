"""Logprob entries, vLLM's shape: per token, {token id: logprob} of the token itself and the top
N alternatives. Shared by the sampled tokens' logprobs and the prompt's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# Prompt positions whose logits one [rows, V] tensor holds at a time: 256 x 49,152 float32
# is 50 MB, while a 4,096-token chunk at once would be 800 MB.
PROMPT_LOGITS_ROWS = 256


def logprob_entries(logp: torch.Tensor, tokens: Sequence[int], n: int) -> list[dict[int, float]]:
    """Row j of log-probabilities ``logp`` [R, V]: {tokens[j]: its logprob} plus the top n."""
    own = logp.gather(1, torch.tensor(list(tokens), device=logp.device)[:, None])[:, 0].tolist()
    entries = [{tok: lp} for tok, lp in zip(tokens, own, strict=True)]
    if n:
        top = logp.topk(n)
        for entry, ids, lps in zip(entries, top.indices.tolist(), top.values.tolist(), strict=True):
            entry.update(zip(ids, lps, strict=True))
    return entries


@torch.inference_mode()
def prompt_logprob_entries(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    first: int,
    prompt_token_ids: Sequence[int],
    n: int,
) -> list[dict[int, float]]:
    """Entries of prompt tokens first + 1 .. first + k from the final hidden states [k, H] of
    positions first .. first + k - 1 (position p's logits predict token p + 1), a slice of
    rows at a time."""
    entries: list[dict[int, float]] = []
    for a in range(0, hidden.shape[0], PROMPT_LOGITS_ROWS):
        logp = compute_logits(hidden[a : a + PROMPT_LOGITS_ROWS]).log_softmax(-1)
        targets = prompt_token_ids[first + a + 1 : first + a + 1 + logp.shape[0]]
        entries += logprob_entries(logp, targets, n)
    return entries
