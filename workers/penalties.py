"""``logit_bias``, ``min_tokens`` and the penalties: the logits a request chooses its next
token from, given what it has said so far.

Applied as vLLM applies them (its sampler), in this order, to a step's raw logits:

- ``min_tokens``: until the output has that many tokens, EOS (unless ``ignore_eos``) and the
  ``stop_token_ids`` get -inf, so they are never chosen (the detokenizer lets no stop string
  count until then either);
- ``logit_bias`` (OpenAI): ``logits[t] += bias`` for each token id it names;
- ``repetition_penalty`` r (vLLM's extra; CTRL's, as transformers'
  ``RepetitionPenaltyLogitsProcessor``): the logit of every token in the prompt or the output
  so far is divided by r when positive, multiplied by r when not;
- ``frequency_penalty`` f, then ``presence_penalty`` p (OpenAI's definition: the output so
  far only): ``logits[t] -= f * count(t)``, then ``logits[t] -= p * (count(t) > 0)``.

Greedy and sampled rows alike choose from the result (so temperature, top-k and top-p come
after). The output so far includes tokens resumed from another worker, so a resumed request
chooses exactly as the unbroken run would. Logprobs stay those of the raw logits, as vLLM
reports them by default.
"""

from __future__ import annotations

import array
from collections.abc import Collection, Sequence

import torch

from kvmesh.workers.sampling_params import SamplingParams


def penalize(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """``logits`` [B, V] with each row's ``min_tokens``, ``logit_bias`` and penalties applied
    (``eos_token_ids``: the model's EOS tokens): the same tensor when no row has any, else a
    new one (the raw logits stay as they were, for logprobs).
    Row ``r`` has said ``prompts[r]`` and then ``outputs[r]``. All rows go together (a row
    without any has a penalty of 0, or 1 for repetition: no bit changes), and only the
    logits of the tokens concerned are read and written."""
    if not any(p.penalized for p in params):
        return logits
    device, vocab = logits.device, logits.shape[1]
    x = logits.clone()
    flat_x = x.view(-1)  # row r's token t is at r * V + t

    def per_row(values: list[float]) -> torch.Tensor:  # [B]
        return torch.tensor(values, dtype=x.dtype, device=device)

    def flat(token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.cat([_ids(ts, device) + r * vocab for r, ts in enumerate(token_lists)])

    banned = [
        r * vocab + t
        for r, p in enumerate(params)
        if len(outputs[r]) < p.min_tokens
        for t in {*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)}
        if t < vocab
    ]
    if banned:
        flat_x[_ids(banned, device)] = float("-inf")
    biased = [(r * vocab + t, b) for r, p in enumerate(params) for t, b in p.logit_bias]
    if biased:
        at, bias = zip(*biased, strict=True)
        flat_x.index_add_(0, _ids(at, device), per_row(list(bias)))
    out = flat(outputs)
    if any(p.repetition_penalty != 1.0 for p in params):
        # Only the logits of seen tokens (a where() over [B, V] costs ~1 ms on a CPU); an index
        # seen twice is written twice with the same value.
        pr = [
            ids if p.repetition_penalty != 1.0 else ()
            for ids, p in zip(prompts, params, strict=True)
        ]
        seen = torch.cat([out, flat(pr)])
        rep = per_row([p.repetition_penalty for p in params])[seen // vocab]
        v = flat_x[seen]
        flat_x[seen] = torch.where(v > 0, v / rep, v * rep)
    if len(out) and any(p.frequency_penalty or p.presence_penalty for p in params):
        used, counts = out.unique(return_counts=True)
        row = used // vocab
        v = flat_x[used]
        v -= per_row([p.frequency_penalty for p in params])[row] * counts.to(x.dtype)
        v -= per_row([p.presence_penalty for p in params])[row]
        flat_x[used] = v
    return x


def _ids(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    """Token ids (or flat indices) as an int64 tensor; through an array, ~6x faster than
    from a list."""
    if not tokens:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array.array("q", tokens), dtype=torch.int64).to(device)
