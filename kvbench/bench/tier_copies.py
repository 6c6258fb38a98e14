"""The fixture that every measure of tier bandwidth (SPEC §11) shares: a pool of one block size
with every block filled, its host and disk tiers made by its own ``attach_tiers``, and a store
(scattered device blocks, a random permutation of the pool, into consecutive tier slots) and a
load (the reverse) through the pool's own copies. scripts/tier_bandwidth.py, the asv suite
(asv_bench/benchmarks/bench_tiers.py) and the ratio gate ``tier_copy_vs_copy`` time it beside a
plain copy of the same bytes."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from kvbench.contract import registry
from kvbench.contract.formulas import ModelSpec
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.tier_ops import TierSpec

BLOCK_SIZE = 16  # tokens per block
TIERS = ("host", "disk")


def model_for(block_bytes: int) -> ModelSpec:
    """A model whose block of 16 fp16 tokens is ``block_bytes``: 2 * L * H * D * 2 * 16 bytes."""
    elems = block_bytes // (2 * 2 * BLOCK_SIZE)  # L * H * D
    return ModelSpec(f"bw{block_bytes}", layers=2, kv_heads=max(1, elems // 256), head_dim=128)


@dataclass
class TierCopies:
    pool: object  # the backend, tiers attached
    blocks: np.ndarray  # device blocks in the order a store takes them
    slots: np.ndarray  # the tier slots they go to: 0 .. n-1
    flat: np.ndarray  # the pool's bytes, one flat NumPy array (a view)
    nbytes: int

    def tier(self, name: str):
        return self.pool._tiers[self.pool._tier(name)]

    def store(self, name: str) -> None:
        self.pool._copy_down(self.tier(name), self.blocks, self.slots)

    def load(self, name: str) -> None:
        self.pool._copy_up(self.tier(name), self.slots, self.blocks)

    def close(self) -> None:
        self.pool.close()


def tier_copies(backend: str, block_kib: int, total_bytes: int, seed: int = 0,
                tiers=TIERS) -> TierCopies:
    """``backend`` ("numpy", "torch") with ``total_bytes`` in blocks of ``block_kib`` KiB (4 at
    least), every byte written, and ``tiers`` (host, disk) of as many blocks; the pool is closed
    (its disk files removed) when the fixture goes."""
    block_bytes = block_kib << 10
    n = max(4, total_bytes // block_bytes)
    pool = registry.create(backend, CacheConfig(model=model_for(block_bytes), block_size=BLOCK_SIZE,
                                                num_blocks=n))
    pool._commit(n)
    if pool.block_bytes() != block_bytes:
        raise ValueError(f"tier_copies: a block of {pool.block_bytes()} bytes, not {block_bytes}")
    rng = np.random.default_rng(seed)
    flat = (pool.pool if isinstance(pool.pool, np.ndarray) else pool.pool.numpy()).reshape(-1)
    flat[...] = rng.integers(-1000, 1000, size=flat.shape).astype(flat.dtype)
    pool.attach_tiers(tuple(TierSpec(t, n) for t in tiers))
    tc = TierCopies(pool, rng.permutation(n).astype(np.intp), np.arange(n), flat, n * block_bytes)
    weakref.finalize(tc, pool.close)
    return tc
