"""Paged attention over a flat batch of tokens from many sequences, prefills and decodes mixed.

`AttentionMetadata` describes one model step (shared by every layer); an `AttentionBackend`
writes the step's new K/V into the paged cache and attends. Two backends: `TorchAttentionBackend`
(pure torch, any device, the CPU path) and `FlashAttentionBackend` (vllm-flash-attn on CUDA,
flash_attention.py).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvmesh.workers.cascade_attention import CascadeDecode, find_shared_prefix
from kvmesh.workers.cpu_attention import CpuAttentionPlan, kernel_rows
from kvmesh.workers.cpu_kernels import kernel_library


@dataclass
class AttentionMetadata:
    """One step's batch: T new tokens from B sequences, laid out sequence after sequence.

    Sequence b owns tokens query_start_loc[b] .. query_start_loc[b+1]-1 of the flat batch; they
    sit at positions seq_lens[b] - query_len_b .. seq_lens[b] - 1 of that sequence, whose KV
    for positions 0 .. seq_lens[b]-1 lives in blocks block_tables[b, :] (the ones before the
    new tokens were cached by earlier steps or by a prefix-cache hit).
    """

    query_start_loc: torch.Tensor  # int32 [B+1], cumulative query lengths, starts at 0
    seq_lens: torch.Tensor  # int32 [B], context length after this step (cached + new)
    block_tables: torch.Tensor  # int32 [B, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [T], block_id * block_size + offset of each new token
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Backend-owned scratch for index tensors derived once per step and reused by every layer.
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        """Everything from per-sequence lists. Raises ValueError if a sequence has no new token,
        more new tokens than context, or too few blocks for its seq_len."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables need one entry per sequence")
        slots: list[int] = []
        for q, s, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 1 <= q <= s:
                raise ValueError(f"need 1 <= query_len <= seq_len, got {q} and {s}")
            if len(table) * block_size < s:
                raise ValueError(f"{len(table)} blocks cannot hold seq_len {s}")
            slots.extend(
                table[p // block_size] * block_size + p % block_size for p in range(s - q, s)
            )
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        starts = [0, *itertools.accumulate(query_lens)]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=list(query_lens),
            seq_lens_cpu=list(seq_lens),
        )


class AttentionBackend(ABC):
    """Paged causal attention for one layer.

    `forward(q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D], k_cache, v_cache [N,bs,Hkv,D], meta, scale)
    -> [T,Hq,D]` first writes k[t], v[t] into the caches at flat slot meta.slot_mapping[t]
    (slot = block_id * bs + offset), then computes, for every new token t of sequence b at
    position p = seq_lens[b] - query_len_b + i, softmax(scale * q[t] . K_b[0..p]) @ V_b[0..p],
    where K_b/V_b are read from sequence b's blocks (so a cached prefix is attended to).
    Query head h uses KV head h // (Hq // Hkv) (GQA). Output dtype is q's dtype.
    """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's k, v at their slots; returns them as the cache holds them (its dtype),
    which is what attention must see, so that a prompt attends alike whether its K/V came from
    this step or from the cache (a prefix hit, a pull)."""
    # [N, bs, Hkv, D] -> [N*bs, Hkv, D]: a flat slot indexes one token's K (or V) of all heads.
    n, bs, hkv, d = k_cache.shape
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    k_cache.view(n * bs, hkv, d).index_copy_(0, slots, k)
    v_cache.view(n * bs, hkv, d).index_copy_(0, slots, v)
    return k, v


def _context_blocks(block_tables: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """int64 [B * nb]: each row's first nb = ceil(seq_len / block_size) block ids, flattened, for
    index_select over whole blocks (contiguous chunks: far faster than a per-token gather)."""
    nb = -(-seq_len // block_size)
    return block_tables[:, :nb].reshape(-1).to(torch.int64)


class TorchAttentionBackend(AttentionBackend):
    """Pure torch, any device. Decode rows (query_len == 1) that share a leading run of >= 4
    block ids (a prefix-cache hit) take cascade attention (cascade_attention.py: the shared
    K/V is read once for all of them, each row's suffix separately). Other decode rows go
    through one batched SDPA call over K/V gathered block-wise to [Bd, S', Hkv, D]
    (S' = max blocks * block_size) with a length mask; each prefill row gets one SDPA call
    (is_causal when it has no cached prefix, else a bottom-right causal mask over its gathered
    context). GQA: decode, and prefill over a cached prefix, fold a KV head's query heads into
    SDPA's query-length axis (no K/V copy per query head); a prefill without a cached prefix
    expands its own K/V to Hq heads. Index tensors are derived once per step (meta.scratch)
    and shared by all layers.

    On CPU in float32, with the C kernels built (cpu_kernels.py), rows of at most
    KERNEL_MAX_QUERY_LEN new tokens go through csrc/paged_attention.c instead (cpu_attention.py):
    it reads K/V in place (a float32, bfloat16 or float16 cache) and takes the cascade too.
    A cache of another dtype than q's (``kv_cache_dtype``) is widened to q's as it is read.
    `cpu_kernel=False` keeps pure torch."""

    def __init__(self, cpu_kernel: bool | None = None) -> None:
        self.cpu_kernel = cpu_kernel  # None: when the kernels are available

    def _kernel_rows(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> list[int]:
        if q.dtype != torch.float32 or q.device.type != "cpu" or self.cpu_kernel is False:
            return []
        if self.cpu_kernel is None and kernel_library() is None:
            return []
        return kernel_rows(meta.query_lens_cpu, q.shape[2], q.shape[1], k_cache.shape[2])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k, v = write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        plan = meta.scratch.get("torch_plan")
        if plan is None:
            group = q.shape[1] // k_cache.shape[2]
            rows = self._kernel_rows(q, k_cache, meta)
            plan = _TorchPlan(meta, k_cache.shape[1], k_cache.shape[2], group, q.dtype, rows)
            meta.scratch["torch_plan"] = plan
        t, hq, d = q.shape
        hkv = k_cache.shape[2]
        group = hq // hkv
        out = q.new_empty(q.shape)

        if plan.kernel is not None:
            nk = plan.kernel.num_tokens
            qk = q if nk == t else q.index_select(0, plan.kernel.tokens)
            ok = plan.kernel.forward(qk, k_cache, v_cache, scale)
            if nk == t:
                return ok
            out.index_copy_(0, plan.kernel.tokens, ok)

        if plan.cascade is not None:
            nc = plan.cascade_tokens.shape[0]
            # Decode tokens are sorted, so nc == t means they are exactly 0 .. t-1.
            qc = q if nc == t else q.index_select(0, plan.cascade_tokens)
            oc = plan.cascade.forward(qc, k_cache, v_cache, scale)
            if nc == t:
                return oc
            out.index_copy_(0, plan.cascade_tokens, oc)

        if plan.decode_tokens is not None:
            nd = plan.decode_tokens.shape[0]
            # Query heads of KV head j are rows j*group .. j*group+group-1 (HF's repeat_kv order).
            qd = q if nd == t else q.index_select(0, plan.decode_tokens)
            qd = qd.view(nd, hkv, group, d)  # [Bd, Hkv, G, D]
            # [Bd * nb, bs, Hkv, D] -> [Bd, Hkv, S', D] (SDPA reads the strided view, no copy)
            kd = k_cache.index_select(0, plan.decode_blocks).view(nd, -1, hkv, d).transpose(1, 2)
            vd = v_cache.index_select(0, plan.decode_blocks).view(nd, -1, hkv, d).transpose(1, 2)
            od = F.scaled_dot_product_attention(  # mask [Bd, 1, 1, S'] -> out [Bd, Hkv, G, D]
                qd, kd.to(q.dtype), vd.to(q.dtype), attn_mask=plan.decode_mask, scale=scale
            )
            if nd == t:
                return od.reshape(nd, hq, d)
            out.index_copy_(0, plan.decode_tokens, od.reshape(nd, hq, d))

        for start, end, seq_len, blocks, mask in plan.prefills:
            lq = end - start
            if blocks is None:  # no cached prefix: the context is exactly this step's k, v
                qp = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, Lq, D]
                # [Lq, Hkv, D] -> [1, Hq, Lq, D]: a copy, but only as long as the query
                kp, vp = (
                    x[start:end].to(q.dtype).repeat_interleave(group, 1).transpose(0, 1)[None]
                    for x in (k, v)
                )
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
                out[start:end] = op[0].transpose(0, 1)
                continue
            # A cached prefix: the context is far longer than the query, so fold each KV
            # head's G query heads into the query axis (rows g * Lq + i) instead of copying
            # the gathered K/V once per query head. [Lq, Hq, D] -> [1, Hkv, G * Lq, D]
            qp = q[start:end].view(lq, hkv, group, d).permute(1, 2, 0, 3)
            qp = qp.reshape(1, hkv, group * lq, d)
            # [nb * bs, Hkv, D] -> [1, Hkv, S, D] (a strided view: SDPA reads it in place)
            kp = k_cache.index_select(0, blocks).view(-1, hkv, d)[:seq_len]
            vp = v_cache.index_select(0, blocks).view(-1, hkv, d)[:seq_len]
            kp = kp.to(q.dtype).transpose(0, 1).unsqueeze(0)
            vp = vp.to(q.dtype).transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
            # [1, Hkv, G * Lq, D] -> [Lq, Hq, D]
            out[start:end] = op.view(hkv, group, lq, d).permute(2, 0, 1, 3).reshape(lq, hq, d)
        return out


class _TorchPlan:
    """Index tensors and masks (in the step's q dtype) for TorchAttentionBackend, derived from
    one step's metadata."""

    def __init__(
        self,
        meta: AttentionMetadata,
        block_size: int,
        num_kv_heads: int,
        group: int,
        dtype: torch.dtype,
        for_kernel: list[int],
    ) -> None:
        device = meta.block_tables.device
        starts = [0, *itertools.accumulate(meta.query_lens_cpu)]
        self.kernel: CpuAttentionPlan | None = None
        if for_kernel:
            self.kernel = CpuAttentionPlan(meta, starts, for_kernel, block_size)
        taken = set(for_kernel)
        decode = [b for b, ql in enumerate(meta.query_lens_cpu) if ql == 1 and b not in taken]
        # Decode rows sharing a leading run of blocks take the cascade; the rest the plain path.
        self.cascade: CascadeDecode | None = None
        self.cascade_tokens = torch.empty(0, dtype=torch.int64)
        if len(decode) >= 2:
            tables = meta.block_tables[torch.tensor(decode, device=device)]
            picked, shared = find_shared_prefix(
                tables, [meta.seq_lens_cpu[b] for b in decode], block_size
            )
            if picked:
                rows = [decode[i] for i in picked]
                self.cascade_tokens = torch.tensor([starts[b] for b in rows], device=device)
                self.cascade = CascadeDecode(
                    tables[torch.tensor(picked, device=device)],
                    [meta.seq_lens_cpu[b] for b in rows],
                    shared,
                    block_size,
                    num_kv_heads,
                )
                decode = sorted(set(decode) - set(rows))
        self.decode_tokens: torch.Tensor | None = None
        self.decode_blocks = torch.empty(0, dtype=torch.int64)
        self.decode_mask = torch.empty(0, dtype=dtype)
        if decode:
            rows_t = torch.tensor(decode, dtype=torch.int64, device=device)
            max_len = max(meta.seq_lens_cpu[b] for b in decode)
            self.decode_tokens = torch.tensor([starts[b] for b in decode], device=device)
            self.decode_blocks = _context_blocks(meta.block_tables[rows_t], max_len, block_size)
            width = self.decode_blocks.shape[0] // len(decode) * block_size  # S'
            lens = meta.seq_lens[rows_t].to(torch.int64)
            valid = torch.arange(width, device=device)[None, :] < lens[:, None]  # [Bd, S']
            self.decode_mask = _additive(valid[:, None, None, :], dtype)  # [Bd, 1, 1, S']
        # (first token, end token, seq_len, context block ids, [G * Lq, S] additive mask: query
        # heads folded, row g * Lq + i is query i); the last two are None without a cached prefix.
        self.prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor | None]] = []
        for b, (ql, sl) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            if ql == 1 or b in taken:
                continue
            if ql == sl:
                self.prefills.append((starts[b], starts[b + 1], sl, None, None))
                continue
            blocks = _context_blocks(meta.block_tables[b : b + 1], sl, block_size)
            # Query i sits at position sl - ql + i and sees keys 0 .. sl - ql + i.
            qpos = torch.arange(sl - ql, sl, device=device)
            mask = torch.arange(sl, device=device)[None, :] <= qpos[:, None]  # [Lq, S]
            folded = _additive(mask, dtype).repeat(group, 1)  # [G * Lq, S]
            self.prefills.append((starts[b], starts[b + 1], sl, blocks, folded))


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA's additive float mask (0 where allowed, -inf where not),
    made once per step: SDPA would otherwise convert the bool mask in every layer."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return zero.masked_fill(~allowed, float("-inf"))


def get_attn_backend(
    name: str | None, device: torch.device | str, dtype: torch.dtype | None = None
) -> AttentionBackend:
    """The backend called `name`: "torch", "flash", or None for flash on CUDA when importable
    and `dtype` is fp16/bf16 (flash kernels take nothing else), else torch. Raises ValueError
    for an unknown name or "flash" off CUDA, ImportError for "flash" without a flash package."""
    from kvmesh.workers.flash_attention import FlashAttentionBackend  # imports this module

    dev = torch.device(device)
    if name is None:
        if dev.type == "cuda" and dtype in (None, torch.float16, torch.bfloat16):
            try:
                return FlashAttentionBackend()
            except ImportError:
                pass
        return TorchAttentionBackend()
    if name == "torch":
        return TorchAttentionBackend()
    if name == "flash":
        if dev.type != "cuda":
            raise ValueError(f"attention backend 'flash' needs a CUDA device, not {dev}")
        return FlashAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose 'torch', 'flash' or None)")
