"""The paged KV cache: one contiguous tensor, allocated once per worker.

Layout of `KVCache.data` (C-contiguous):

    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]      2 = (K, V)

so the (layer, kv, block) slab, i.e. `data[layer, kv, block_id]`, is `block_nbytes` contiguous
bytes (block_size * num_kv_heads * head_dim * itemsize) starting at

    block_offset(layer, kv, block_id) = ((layer * 2 + kv) * num_blocks + block_id) * block_nbytes

from `data.data_ptr()`. A transport (NIXL) registers `data` once and describes each block with
num_layers * 2 such descriptors. Within a slab, a token's K (or V) for all KV heads is
contiguous, which is what paged attention kernels (flash-attn's block_table) expect for
`layer(i)`'s views of shape [num_blocks, block_size, num_kv_heads, head_dim].

A block's "bytes" (`read_block` / `write_block`) are its slabs concatenated in (layer, kv)
order: num_layers * 2 * block_nbytes bytes, the raw little-endian element bytes of the dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvmesh.workers.model_config import ModelConfig


class KVCache:
    """The K and V of every layer for `num_blocks` blocks of `block_size` tokens.

    Blocks are addressed by id; which ids a sequence owns is the KV cache manager's business.
    """

    def __init__(self, data: torch.Tensor) -> None:
        if data.dim() != 6 or data.shape[1] != 2 or not data.is_contiguous():
            raise ValueError(
                "data must be a contiguous [num_layers, 2, num_blocks, block_size, "
                f"num_kv_heads, head_dim] tensor, got shape {tuple(data.shape)}"
            )
        self.data = data
        self.num_layers, _, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim = (
            data.shape
        )

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        """A zero-filled cache; zeros so that never-written slots hold finite values."""
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device))

    @staticmethod
    def nbytes_for(
        config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes of a cache of `num_blocks` blocks (all layers, K and V)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_block = config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim
        return num_blocks * per_block * itemsize

    @staticmethod
    def num_blocks_for_memory(
        config: ModelConfig, block_size: int, dtype: torch.dtype, nbytes: int
    ) -> int:
        """How many whole blocks (all layers, K and V) fit in `nbytes` bytes."""
        return nbytes // KVCache.nbytes_for(config, 1, block_size, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_nbytes(self) -> int:
        """Bytes of one (layer, K/V, block) slab: block_size * Hkv * head_dim * itemsize."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.data.element_size()

    @property
    def block_bytes_all_layers(self) -> int:
        """Bytes of one block over all layers, K and V: the length of `read_block`'s result."""
        return self.num_layers * 2 * self.block_nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache."""
        return self.data.numel() * self.data.element_size()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (k_cache, v_cache) of layer i, each [num_blocks, block_size, num_kv_heads,
        head_dim] and contiguous; writes through them land in `data`."""
        return self.data[i, 0], self.data[i, 1]

    def block_offset(self, layer: int, kv: int, block_id: int) -> int:
        """Byte offset of the (layer, kv, block_id) slab from the start of `data`."""
        if not (0 <= layer < self.num_layers and kv in (0, 1) and 0 <= block_id < self.num_blocks):
            raise IndexError(f"no slab (layer={layer}, kv={kv}, block_id={block_id})")
        return ((layer * 2 + kv) * self.num_blocks + block_id) * self.block_nbytes

    def read_block(self, block_id: int) -> bytes:
        """A copy of block `block_id`'s K and V for all layers, as bytes in (layer, kv) order."""
        self._check_block(block_id)
        slabs = self.data[:, :, block_id].contiguous().cpu()  # [L, 2, bs, Hkv, D]
        return slabs.view(torch.uint8).numpy().tobytes()

    def read_block_into(self, block_id: int, out: torch.Tensor) -> None:
        """Copy block `block_id` into `out`, a host uint8 tensor of `block_bytes_all_layers`,
        laid out as `read_block`'s bytes: one copy, straight from a GPU into pinned memory."""
        self._check_block(block_id)
        self._as_block(out).copy_(self.data[:, :, block_id])

    def export_blocks(self, block_ids: Sequence[int]) -> np.ndarray:
        """Several blocks as one flat uint8 array, each laid out as `read_block` does, in the
        order given. Raises IndexError for an id out of range."""
        ids = list(block_ids)
        for b in ids:
            self._check_block(b)
        index = torch.tensor(ids, dtype=torch.long, device=self.device)
        # [L, 2, n, ...] -> [n, L, 2, ...]: block-major, as read_block concatenates slabs.
        blocks = self.data.index_select(2, index).movedim(2, 0).contiguous()
        return blocks.cpu().view(torch.uint8).reshape(-1).numpy()

    def write_block(self, block_id: int, data: bytes | memoryview | torch.Tensor) -> None:
        """Overwrite block `block_id` with the bytes `read_block` (or `read_block_into`) gives of
        a compatible cache (same layers, block size, KV heads, head dim and dtype): bytes, any
        buffer of them, or a host uint8 tensor, copied once. Raises ValueError on a size
        mismatch, before touching the cache."""
        self._check_block(block_id)
        self.data[:, :, block_id].copy_(self._as_block(host_bytes_tensor(data)))

    def _as_block(self, raw: torch.Tensor) -> torch.Tensor:
        """A block's bytes seen as its [L, 2, bs, Hkv, D] elements (no copy)."""
        if raw.numel() != self.block_bytes_all_layers:
            raise ValueError(
                f"block data is {raw.numel()} bytes, expected {self.block_bytes_all_layers}"
            )
        return raw.view(self.dtype).view(
            self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim
        )

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block_id {block_id} out of range [0, {self.num_blocks})")


def host_bytes_tensor(data: bytes | memoryview | torch.Tensor) -> torch.Tensor:
    """Bytes as a flat uint8 tensor over their own memory; a read-only buffer (bytes) is
    copied first, as torch wants a writable one (it is only read)."""
    if isinstance(data, torch.Tensor):
        return data.reshape(-1)
    view = memoryview(data).cast("B")
    if view.readonly:
        view = memoryview(bytearray(view))
    return torch.frombuffer(view, dtype=torch.uint8)
