"""``allowed_token_ids``, ``bad_words``, ``min_tokens``, ``logit_bias`` and the penalties: the
logits a request chooses its next token from, given what it has said so far.

Applied as vLLM applies them (its sampler), in this order, to a step's raw logits:

- ``allowed_token_ids`` (vLLM's): every other token gets -inf;
- ``bad_words`` (vLLM's), as ``bad_words_token_ids`` (``bad_words.py``): a word of one token
  gets -inf at every step; a longer one's last token gets -inf when the output so far ends
  with the word's other tokens;
- ``min_tokens``: until the output has that many tokens, EOS (unless ``ignore_eos``) and the
  ``stop_token_ids`` get -inf, so they are never chosen (the detokenizer lets no stop string
  count until then either);
- ``logit_bias`` (OpenAI): ``logits[t] += bias`` for each token id it names;
- ``repetition_penalty`` r (vLLM's extra; CTRL's, as transformers'
  ``RepetitionPenaltyLogitsProcessor``): the logit of every token in the prompt or the output
  so far is divided by r when positive, multiplied by r when not;
- ``frequency_penalty`` f, then ``presence_penalty`` p (OpenAI's definition: the output so
  far only): ``logits[t] -= f * count(t)``, then ``logits[t] -= p * (count(t) > 0)``.

A -inf stays -inf through the later steps. Greedy and sampled rows alike choose from the
result (so temperature, min-p, top-k and top-p come after, and never pick a -inf token). The
output so far includes tokens resumed from another worker, so a resumed request chooses
exactly as the unbroken run would. Logprobs stay those of the raw logits, as vLLM reports them
by default (its ``raw_logprobs``): a banned or not allowed token keeps its logprob among the
top N, as it does under a ``logit_bias``. Where the masks could leave a row no token at all
from the start (``allowed_token_ids`` all banned by one-token bad words, or by EOS and stop
tokens under ``min_tokens``) the request is refused; where a longer bad word does, after
some output, what the row picks is undefined, as in vLLM.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Collection, Sequence

import torch

from kvmesh.workers.bad_words import banned_tokens
from kvmesh.workers.sampling_params import SamplingParams


def penalize(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """``logits`` [B, V] with each row's masks, ``min_tokens``, ``logit_bias`` and penalties
    applied (``eos_token_ids``: the model's EOS tokens): the same tensor when no row has any,
    else a new one (the raw logits stay as they were, for logprobs).
    Row ``r`` has said ``prompts[r]`` and then ``outputs[r]``. All rows go together (a row
    without any has a penalty of 0, or 1 for repetition: no bit changes), and only the
    logits of the tokens concerned are read and written (the whole row of one with
    ``allowed_token_ids``)."""
    if not any(p.penalized for p in params):
        return logits
    device, vocab = logits.device, logits.shape[1]
    x = logits.clone()
    flat_x = x.view(-1)  # row r's token t is at r * V + t

    def per_row(values: list[float]) -> torch.Tensor:  # [B]
        return torch.tensor(values, dtype=x.dtype, device=device)

    def flat(token_lists: Sequence[Sequence[int]]) -> torch.Tensor:
        return torch.cat([_ids(ts, device) + r * vocab for r, ts in enumerate(token_lists)])

    for r, p in enumerate(params):  # -inf but at the allowed ids
        if p.allowed_token_ids is not None:
            ids = _allowed_ids(p.allowed_token_ids, vocab, device)
            kept = x[r].index_select(0, ids)
            x[r].fill_(float("-inf")).index_copy_(0, ids, kept)
    banned = [
        r * vocab + t
        for r, p in enumerate(params)
        for t in banned_tokens(p.bad_words_token_ids, outputs[r])
        if t < vocab
    ]
    banned += [
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


@functools.lru_cache(maxsize=256)
def _allowed_ids(allowed: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """A request's allowed ids of the vocabulary (the engine refuses others) as a tensor on
    ``device``, made once for all its steps (made each step, it cost twice the masking)."""
    return _ids([t for t in allowed if t < vocab], device)


def _ids(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    """Token ids (or flat indices) as an int64 tensor; through an array, ~6x faster than
    from a list."""
    if not tokens:
        return torch.empty(0, dtype=torch.int64, device=device)
    return torch.frombuffer(array.array("q", tokens), dtype=torch.int64).to(device)
