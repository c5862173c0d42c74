"""Portable, chained block hashes and the model fingerprint that namespaces them.

Only full blocks are hashed: ``h_i = H(h_{i-1}, tokens_i, extra_i)`` with ``h_{-1}`` derived
from a namespace (the model fingerprint). The bytes hashed are canonical msgpack of that tuple
and the digest is xxh3-128, so a hash is the same in every process, on every machine and under
every ``PYTHONHASHSEED``: workers of one cluster can compare blocks by hash alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgpack
import xxhash

BlockHash = bytes
"""A 16-byte xxh3-128 digest identifying one full block and its whole prefix."""

HASH_VERSION = 1  # bump when the hashed tuple changes: old and new hashes must never meet


def _digest(obj: Any) -> BlockHash:
    return xxhash.xxh3_128_digest(msgpack.packb(obj, use_bin_type=True))


def namespace_hash(namespace: bytes) -> BlockHash:
    """``h_{-1}``: the root every chain in this namespace starts from."""
    return _digest(("kvmesh-block-hash", HASH_VERSION, namespace))


def cache_namespace(namespace: bytes, cache_salt: str | None) -> bytes:
    """The namespace a request's blocks hash in: the model's own, or with a cache salt (vLLM's
    ``cache_salt``) one of that salt's, so requests whose salts differ (or one has none) never
    share a block anywhere: not in a pool, the index, a peer's pull or a tier. Tenants that do
    not trust each other salt their requests, and nobody can tell from a hit's speed what the
    others sent."""
    if cache_salt is None:
        return namespace
    return msgpack.packb(["kvmesh-cache-salt", namespace, cache_salt], use_bin_type=True)


def hash_block(parent: BlockHash, tokens: Sequence[int], extra: Any = None) -> BlockHash:
    """``H(parent, tokens, extra)``; ``extra`` must be msgpack-able (e.g. a LoRA name)."""
    return _digest((parent, list(tokens), extra))


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    namespace: bytes,
    extra_keys: Sequence[Any] | None = None,
) -> list[BlockHash]:
    """One chained hash per full block of ``token_ids``; a trailing partial block is skipped.

    ``extra_keys``, when given, holds one msgpack-able key per full block (at least as many as
    there are full blocks) that is folded into that block's hash.
    """
    hasher = BlockHasher(block_size, namespace)
    return hasher.extend(token_ids, extra_keys)


class BlockHasher:
    """Incremental form of :func:`block_hashes` for a growing sequence.

    Feed it tokens as they arrive; it hashes each block once, when the block fills.
    """

    def __init__(self, block_size: int, namespace: bytes) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.hashes: list[BlockHash] = []
        self._root = namespace_hash(namespace)
        self._pending: list[int] = []

    @property
    def num_tokens(self) -> int:
        """Tokens seen so far."""
        return len(self.hashes) * self.block_size + len(self._pending)

    def extend(
        self, token_ids: Sequence[int], extra_keys: Sequence[Any] | None = None
    ) -> list[BlockHash]:
        """Append tokens; return the hashes of the blocks they completed (maybe none).

        ``extra_keys[j]`` is the key of the j-th block completed by this call.
        """
        new: list[BlockHash] = []
        bs = self.block_size
        pending = self._pending
        pos = 0
        while pos < len(token_ids):
            take = min(bs - len(pending), len(token_ids) - pos)
            pending.extend(token_ids[pos : pos + take])
            pos += take
            if len(pending) == bs:
                if extra_keys is None:
                    extra = None
                elif len(new) < len(extra_keys):
                    extra = extra_keys[len(new)]
                else:
                    raise ValueError(
                        f"extra_keys has {len(extra_keys)} entries but more blocks were filled"
                    )
                parent = self.hashes[-1] if self.hashes else self._root
                new.append(hash_block(parent, pending, extra))
                self.hashes.append(new[-1])
                pending.clear()
        return new


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes two workers' KV bytes interchangeable.

    Workers whose fingerprints differ never share a block: the fingerprint is the namespace of
    every block hash, so their hashes never collide, and peers compare it at handshake.
    """

    weights_id: str  # digest of the weight bytes or of the checkpoint file
    dtype: str  # KV cache dtype, e.g. "float32", "bfloat16"
    block_size: int
    kv_layout: str  # e.g. "L2NBHD": [layers, K/V, blocks, block_size, kv_heads, head_dim]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # The rest changes the numbers computed, so the KV bytes of every layer after the first
    # (defaults: what a plain torch engine on the CPU has).
    attention: str = "TorchAttentionBackend"  # backend class, "+cpu_kernel.vN" with the C kernel
    device: str = "cpu"  # device type: "cpu", "cuda"
    compute_dtype: str = "float32"  # the model's dtype (``dtype`` is the cache's)
    quantized_matmul: bool = False  # matmuls on quantized weight blocks (applied, not asked)
    rmsnorm: str = "torch"  # "cpu_kernel": RMSNorm in C (its sums of squares in another order)

    @property
    def namespace(self) -> bytes:
        """Canonical bytes of every field, in a fixed order."""
        fields = asdict(self)
        return msgpack.packb(["kvmesh-fingerprint", 1, *(fields[k] for k in sorted(fields))])

    @property
    def id(self) -> str:
        """A short hex id, for actor names and logs."""
        return xxhash.xxh3_128_hexdigest(self.namespace)[:16]
