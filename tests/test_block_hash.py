import os
import subprocess
import sys

import pytest

from kvmesh.workers.block_hash import (
    BlockHasher,
    ModelFingerprint,
    block_hashes,
    cache_namespace,
    hash_block,
    namespace_hash,
)

NS = b"model-a"
SCRIPT = (
    "from kvmesh.workers.block_hash import block_hashes, ModelFingerprint\n"
    "fp = ModelFingerprint('w', 'float32', 16, 'L2NBHD', 30, 3, 64)\n"
    "hs = block_hashes(list(range(100)), 16, fp.namespace, extra_keys=[('lora', 1)] * 6)\n"
    "print(fp.id, ','.join(h.hex() for h in hs))\n"
)


def test_one_hash_per_full_block_and_chained() -> None:
    tokens = list(range(10))
    hs = block_hashes(tokens, 4, NS)
    assert len(hs) == 2  # the partial third block is not hashed
    assert all(len(h) == 16 for h in hs)  # 128 bits
    assert hs[0] == hash_block(namespace_hash(NS), [0, 1, 2, 3])
    assert hs[1] == hash_block(hs[0], [4, 5, 6, 7])


def test_hash_depends_on_prefix_namespace_and_extra_keys() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4, NS)
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    assert block_hashes([1, 2, 3, 4], 4, b"model-b") != a[:1]
    assert block_hashes([1, 2, 3, 4], 4, NS, extra_keys=["lora-x"]) != a[:1]
    assert block_hashes([1, 2, 3, 4], 4, NS, extra_keys=[None]) == a[:1]


def test_a_cache_salt_roots_a_chain_of_its_own() -> None:
    ns = b"model"
    assert cache_namespace(ns, None) == ns  # unsalted hashes are those before salts came
    tokens = list(range(12))
    chains = {s: block_hashes(tokens, 4, cache_namespace(ns, s)) for s in (None, "a", "b")}
    assert len({h for chain in chains.values() for h in chain}) == 9  # no block in common
    assert block_hashes(tokens, 4, cache_namespace(ns, "a")) == chains["a"]
    assert cache_namespace(b"other", "a") != cache_namespace(ns, "a")


def test_incremental_equals_batch() -> None:
    tokens = list(range(37))
    hasher = BlockHasher(4, NS)
    got = []
    for chunk in (tokens[:3], tokens[3:4], tokens[4:17], tokens[17:]):
        got.extend(hasher.extend(chunk))
    assert got == hasher.hashes == block_hashes(tokens, 4, NS)
    assert hasher.num_tokens == 37


def test_extra_keys_too_short_is_an_error() -> None:
    with pytest.raises(ValueError, match="extra_keys"):
        block_hashes(list(range(8)), 4, NS, extra_keys=["only-one"])


def test_fingerprint_namespace_covers_every_field() -> None:
    base = ModelFingerprint("w", "float32", 16, "L2NBHD", 30, 3, 64)
    variants = [
        ModelFingerprint("w2", "float32", 16, "L2NBHD", 30, 3, 64),
        ModelFingerprint("w", "bfloat16", 16, "L2NBHD", 30, 3, 64),
        ModelFingerprint("w", "float32", 32, "L2NBHD", 30, 3, 64),
        ModelFingerprint("w", "float32", 16, "other", 30, 3, 64),
        ModelFingerprint("w", "float32", 16, "L2NBHD", 29, 3, 64),
        ModelFingerprint("w", "float32", 16, "L2NBHD", 30, 2, 64),
        ModelFingerprint("w", "float32", 16, "L2NBHD", 30, 3, 32),
    ]
    assert len({base.namespace, *(v.namespace for v in variants)}) == 8
    assert len({base.id, *(v.id for v in variants)}) == 8


def test_identical_across_processes_and_hash_seeds() -> None:
    outs = []
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True
        )
        outs.append(run.stdout.strip())
    assert outs[0] == outs[1]
    fp = ModelFingerprint("w", "float32", 16, "L2NBHD", 30, 3, 64)
    hs = block_hashes(list(range(100)), 16, fp.namespace, extra_keys=[("lora", 1)] * 6)
    assert outs[0] == f"{fp.id} " + ",".join(h.hex() for h in hs)
