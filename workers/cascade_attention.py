"""Cascade (shared-prefix) attention for decode rows, used by TorchAttentionBackend.

With prefix caching, decode rows often start with the same physical blocks (a shared prompt).
Plain paged decode gathers and reads that prefix's K/V once per row; cascade attention reads it
once for all rows: every query of every row attends to the shared K/V in one batched matmul per
KV head, each row attends to its own remaining blocks (the suffix) separately, and the two
partial softmaxes combine exactly through their running max and sum of exponentials (the
log-sum-exp merge of FlashInfer and vLLM), all in float32.
"""

from __future__ import annotations

import torch

# Cascade only when at least 2 decode rows share at least this many leading blocks.
MIN_SHARED_BLOCKS = 4


def head_major_rows(
    block_tables: torch.Tensor, start: int, stop: int, block_size: int, num_kv_heads: int
) -> torch.Tensor:
    """int64 [R * Hkv * S], S = (stop - start) * block_size: for row r, KV head h and position s
    of blocks start .. stop-1 of row r's table, the row of the cache viewed as
    [N * block_size * Hkv, D] that holds that token's K (or V) of head h. index_select with it
    gathers straight into a contiguous [R, Hkv, S, D] (no transpose copy afterwards)."""
    device = block_tables.device
    blocks = block_tables[:, start:stop].to(torch.int64)  # [R, nb]
    slots = blocks[:, :, None] * block_size + torch.arange(block_size, device=device)
    slots = slots.reshape(blocks.shape[0], 1, -1)  # [R, 1, S]
    return (slots * num_kv_heads + torch.arange(num_kv_heads, device=device)[:, None]).reshape(-1)


def find_shared_prefix(
    block_tables: torch.Tensor, seq_lens: list[int], block_size: int
) -> tuple[list[int], int]:
    """(row indices, n) of the rows of `block_tables` [R, W] that cascade: the largest group of
    rows whose first block is the same, and n, the number of leading block ids they all share.
    Only blocks before each row's last token count (a row's last block is its own, and is
    never shared), so every cascading row keeps >= 1 suffix token. ([], 0) when fewer than 2
    rows share MIN_SHARED_BLOCKS blocks."""
    full = torch.tensor([(s - 1) // block_size for s in seq_lens])  # shareable blocks per row
    candidates = (full >= MIN_SHARED_BLOCKS).nonzero().flatten()
    if candidates.numel() < 2:
        return [], 0
    first = block_tables[:, 0].cpu()
    ids, counts = first[candidates].unique(return_counts=True)
    if counts.max() < 2:
        return [], 0
    rows = candidates[first[candidates] == ids[counts.argmax()]]
    limit = int(full[rows].min())
    tables = block_tables[rows.to(block_tables.device), :limit].cpu()
    differs = (tables != tables[:1]).any(0).nonzero()
    shared = int(differs[0]) if differs.numel() else limit
    if shared < MIN_SHARED_BLOCKS:
        return [], 0
    return rows.tolist(), shared


class CascadeDecode:
    """Index tensors for one step's cascading decode rows (built once, used by every layer)
    and the attention itself.

    `block_tables` [Bc, W] are the rows' tables, all starting with the same `num_shared`
    block ids; `seq_lens` their context lengths, each > num_shared * block_size.
    """

    def __init__(
        self,
        block_tables: torch.Tensor,
        seq_lens: list[int],
        num_shared: int,
        block_size: int,
        num_kv_heads: int,
    ) -> None:
        device = block_tables.device
        hkv = num_kv_heads
        self.shared_rows = head_major_rows(block_tables[:1], 0, num_shared, block_size, hkv)
        stop = -(-max(seq_lens) // block_size)
        self.suffix_rows = head_major_rows(block_tables, num_shared, stop, block_size, hkv)
        width = (stop - num_shared) * block_size
        lens = torch.tensor(seq_lens, device=device) - num_shared * block_size
        pad = torch.arange(width, device=device)[None, :] >= lens[:, None]  # [Bc, S2]
        self.suffix_pad = pad[:, None, None, :]  # [Bc, 1, 1, S2]

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [Bc, Hq, D] (one token per row) -> [Bc, Hq, D] in q's dtype; caches [N, bs, Hkv, D]."""
        bc, hq, d = q.shape
        hkv = k_cache.shape[2]
        g = hq // hkv
        f32 = torch.float32
        kflat, vflat = k_cache.view(-1, d), v_cache.view(-1, d)
        # Query heads of KV head j are j*g .. j*g+g-1 (HF's repeat_kv order).
        qs = (q.to(f32) * scale).view(bc, hkv, g, d)

        # Shared prefix: all Bc*g queries of KV head j against its S1 keys, once.
        k1 = kflat.index_select(0, self.shared_rows).view(hkv, -1, d).to(f32)  # [Hkv, S1, D]
        v1 = vflat.index_select(0, self.shared_rows).view(hkv, -1, d).to(f32)
        q1 = qs.transpose(0, 1).reshape(hkv, bc * g, d)  # [Hkv, Bc*g, D]
        s1 = torch.bmm(q1, k1.transpose(1, 2)).view(hkv, bc, g, -1).transpose(0, 1)
        # Suffix: each row against its own blocks, padding masked out.
        k2 = kflat.index_select(0, self.suffix_rows).view(bc * hkv, -1, d).to(f32)
        v2 = vflat.index_select(0, self.suffix_rows).view(bc * hkv, -1, d).to(f32)
        s2 = torch.bmm(qs.view(bc * hkv, g, d), k2.transpose(1, 2)).view(bc, hkv, g, -1)
        s2.masked_fill_(self.suffix_pad, float("-inf"))

        # Exact merge: both halves exponentiate against the joint max (finite: every row has
        # >= 1 unmasked suffix key), then sum of exps and weighted V sums add.
        m = torch.maximum(s1.amax(-1, keepdim=True), s2.amax(-1, keepdim=True))  # [Bc,Hkv,g,1]
        p1 = s1.sub_(m).exp_()  # in place through the [Hkv, Bc, g, S1] view
        p2 = s2.sub_(m).exp_()
        denom = p1.sum(-1, keepdim=True) + p2.sum(-1, keepdim=True)
        o1 = torch.bmm(p1.transpose(0, 1).reshape(hkv, bc * g, -1), v1)  # [Hkv, Bc*g, D]
        o2 = torch.bmm(p2.view(bc * hkv, g, -1), v2).view(bc, hkv, g, d)
        o = o2.add_(o1.view(hkv, bc, g, d).transpose(0, 1)).div_(denom)
        return o.view(bc, hq, d).to(q.dtype)
