"""Paged attention through csrc/paged_attention.c, for TorchAttentionBackend on CPU in float32
(the cache in float32, bfloat16 or float16: ``KV_DTYPES``).

It takes the rows of few new tokens (decodes, short prefills over a cached prefix): their
attention reads K/V in place in the paged cache, where torch would first gather it, and runs
as one call per layer instead of a dozen small ops. Decode rows that share a leading run of
blocks (a prefix-cache hit) attend to it as one shared item, read once for all of them (the
cascade of cascade_attention.py). Long prefills stay with SDPA, which is compute-bound there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvmesh.workers.cascade_attention import find_shared_prefix
from kvmesh.workers.cpu_kernels import require_library

if TYPE_CHECKING:  # attention.py imports this module
    from kvmesh.workers.attention import AttentionMetadata

# Rows with more new tokens than this go to SDPA.
KERNEL_MAX_QUERY_LEN = 32
# In the KV fingerprint: raised whenever the kernel's results change in their last bits (2:
# decodes summed over 16-wide vectors of head_dim), since every layer's KV after the first
# depends on them and peers and disk tiers must not mix the two.
KERNEL_NUMERICS = 2
# The cache element types the kernel reads, and its code for each.
KV_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class CpuAttentionPlan:
    """The kernel's items for one step (built once, used by every layer).

    `rows` are the batch rows (sequences) the kernel takes; `tokens` their flat-batch token
    indices, ascending (int64), which are the rows of the q the kernel is given.
    """

    def __init__(
        self, meta: AttentionMetadata, starts: list[int], rows: list[int], block_size: int
    ) -> None:
        """`starts`: each row's first token in the flat batch, then the total."""
        query_lens, seq_lens, block_tables = (
            meta.query_lens_cpu,
            meta.seq_lens_cpu,
            meta.block_tables,
        )
        tokens: list[int] = []
        first: dict[int, int] = {}  # row -> index of its first token among `tokens`
        for b in rows:
            first[b] = len(tokens)
            tokens.extend(range(starts[b], starts[b + 1]))
        self.tokens = torch.tensor(tokens, dtype=torch.int64)
        self.num_tokens = len(tokens)

        kv_len: list[int] = []
        blocks: list[int] = []
        block_off: list[int] = []
        q_off: list[int] = []
        nq: list[int] = []
        qtok: list[int] = []
        qlim: list[int] = []

        def item(block_ids: list[int], length: int, queries: list[int], limits: list[int]) -> None:
            kv_len.append(length)
            block_off.append(len(blocks))
            blocks.extend(block_ids)
            q_off.append(len(qtok))
            nq.append(len(queries))
            qtok.extend(queries)
            qlim.extend(limits)

        decode = [b for b in rows if query_lens[b] == 1]
        skip = dict.fromkeys(rows, 0)  # row -> blocks attended through the shared item
        if len(decode) >= 2:
            picked, shared = find_shared_prefix(
                block_tables[decode], [seq_lens[b] for b in decode], block_size
            )
            if picked:
                group = [decode[i] for i in picked]
                n = shared * block_size
                ids = block_tables[group[0], :shared].tolist()
                item(ids, n, [first[b] for b in group], [n] * len(group))
                skip.update(dict.fromkeys(group, shared))
        for b in rows:
            ql, sl, s0 = query_lens[b], seq_lens[b], skip[b]
            nb = -(-sl // block_size)
            ids = block_tables[b, s0:nb].tolist()
            offset = s0 * block_size
            # Query i sits at position sl - ql + i and sees keys 0 .. sl - ql + i.
            limits = [sl - ql + i + 1 - offset for i in range(ql)]
            item(ids, sl - offset, list(range(first[b], first[b] + ql)), limits)

        def i32(xs: list[int]) -> torch.Tensor:
            return torch.tensor(xs, dtype=torch.int32)

        self.num_items = len(kv_len)
        # Kept alive here: the kernel reads them through raw pointers.
        self._arrays = [i32(x) for x in (blocks, kv_len, block_off, q_off, nq, qtok, qlim)]

    def forward(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q float32 [num_tokens, Hq, D] (this plan's tokens in order) -> [num_tokens, Hq, D];
        caches [N, bs, Hkv, D] of a dtype in ``KV_DTYPES``."""
        q = q.contiguous()
        t, hq, d = q.shape
        _, bs, hkv, _ = k_cache.shape
        out = torch.empty_like(q)
        blocks, kv_len, block_off, q_off, nq, qtok, qlim = (a.data_ptr() for a in self._arrays)
        rc = require_library().kva_paged_attention(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), blocks,
            t, hq, hkv, d, bs, self.num_items,
            kv_len, block_off, q_off, nq, qtok, qlim, scale, torch.get_num_threads(),
            KV_DTYPES[k_cache.dtype],
        )  # fmt: skip
        if rc != 0:
            raise RuntimeError(f"paged attention kernel failed (head_dim {d}, {hq}/{hkv} heads)")
        return out


def kernel_rows(
    query_lens: list[int], head_dim: int, num_heads: int, num_kv_heads: int
) -> list[int]:
    """The rows the kernel takes: all with at most KERNEL_MAX_QUERY_LEN new tokens, when the
    head shape suits it (head_dim a multiple of 8), else none."""
    if head_dim % 8 != 0 or num_heads % num_kv_heads != 0:
        return []
    return [b for b, ql in enumerate(query_lens) if ql <= KERNEL_MAX_QUERY_LEN]
