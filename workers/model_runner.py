"""Turns a scheduled batch into tensors, runs the model once, returns logits to sample from."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvmesh.workers.attention import AttentionMetadata
from kvmesh.workers.kv_cache import KVCache
from kvmesh.workers.model import LlamaForCausalLM
from kvmesh.workers.scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVCache) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        # After `run`: for each scheduled request asking for prompt logprobs whose step
        # computed prompt positions before its last, (its index in the batch, the first such
        # position p, final-norm hidden states [k, H] of positions p .. p + k - 1). Logits
        # are left to the caller: [k, V] at once would be too big for a long prompt.
        self.prompt_hidden: list[tuple[int, int, torch.Tensor]] = []

    @torch.inference_mode()
    def run(
        self, batch: Sequence[ScheduledRequest], block_tables: Sequence[list[int]]
    ) -> torch.Tensor:
        """One forward pass over every scheduled token; float32 logits [S, V] for the S
        requests whose step reaches the end of their sequence (``ScheduledRequest.samples``),
        in batch order. A mid-prompt chunk only writes its KV."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        last_rows: list[int] = []
        prompt_rows: list[tuple[int, int, int, int]] = []  # batch index, position, row, count
        for i, s in enumerate(batch):
            start = s.request.num_kv_tokens
            end = start + s.num_new_tokens
            # Position p's logits predict token p + 1: prompt positions before the last.
            k = min(end, s.request.num_prompt_tokens - 1) - start
            if s.request.needs_prompt_logits and k > 0:
                prompt_rows.append((i, start, len(input_ids), k))
            input_ids.extend(s.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(s.num_new_tokens)
            seq_lens.append(end)
            if s.samples:
                last_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build(
            query_lens, seq_lens, list(block_tables), self.kv_cache.block_size, self.device
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_cache,
            meta,
        )
        self.prompt_hidden = [(i, p, hidden[r : r + k]) for i, p, r, k in prompt_rows]
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows))
