"""Store and load bandwidth of the NumPy pool's tiers (SPEC §11), as a ratio to a plain copy of
the same bytes (host) and to a sequential write / read of the same bytes to / from a file (disk),
in the same run, for blocks of 16 KiB to 1 MiB.

A store copies scattered device blocks (a random permutation of the pool) into consecutive tier
slots through the backend's own path (``NumpyTiers._copy_down``), a load the reverse. Ratio =
baseline seconds / tier seconds (1.0: as fast as the plain copy), the median of ``--repeat``
runs. The disk tier writes to np.memmap pages and the baseline to a file, neither synced: both
measure what reaches the page cache.

    python scripts/tier_bandwidth.py [--mib 64] [--repeat 5] [--output results/tiers/bandwidth.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from impls.numpy_paged import NumpyPaged  # noqa: E402
from impls.numpy_tiers import _TierSlots  # noqa: E402
from kvbench.traces.tier_ops import TierSpec  # noqa: E402
from kvbench.contract.formulas import ModelSpec  # noqa: E402
from kvbench.contract.protocol import CacheConfig  # noqa: E402

BLOCK_KIB = (16, 32, 64, 128, 256, 512, 1024)
BLOCK_SIZE = 16  # tokens per block


def model_for(block_bytes: int) -> ModelSpec:
    """A model whose block of 16 fp16 tokens is ``block_bytes``: 2 * L * H * D * 2 * 16 bytes."""
    elems = block_bytes // (2 * 2 * BLOCK_SIZE)  # L * H * D
    return ModelSpec(f"bw{block_bytes}", layers=2, kv_heads=max(1, elems // 256), head_dim=128)


def timed(fn, repeat: int) -> float:
    fn()  # pages touched once before timing
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(kib: int, total_mib: int, repeat: int, folder: str) -> list[dict]:
    block_bytes = kib << 10
    n = max(4, (total_mib << 20) // block_bytes)
    cfg = CacheConfig(model=model_for(block_bytes), block_size=BLOCK_SIZE, num_blocks=n)
    pool = NumpyPaged(cfg)
    pool._commit(n)
    assert pool.block_bytes() == block_bytes, (pool.block_bytes(), block_bytes)
    rng = np.random.default_rng(0)
    pool.pool[...] = rng.integers(-1000, 1000, size=pool.pool.shape).astype(pool.pool.dtype)
    blocks = rng.permutation(n).astype(np.intp)
    slots = np.arange(n)
    flat = pool.pool.reshape(-1)
    rows = []
    for tier in ("host", "disk"):
        t = _TierSlots(TierSpec(tier, n), pool._storage(), folder)
        store = timed(lambda: pool._copy_down(t, blocks, slots), repeat)
        load = timed(lambda: pool._copy_up(t, slots, blocks), repeat)
        if tier == "host":
            buf = np.empty_like(flat)
            base_store = base_load = timed(lambda: np.copyto(buf, flat), repeat)
        else:
            path = os.path.join(folder, f"seq-{kib}.bin")

            def write():
                with open(path, "wb") as f:
                    f.write(memoryview(flat).cast("B"))

            buf = np.empty_like(flat)

            def read():
                with open(path, "rb") as f:
                    f.readinto(memoryview(buf).cast("B"))

            base_store = timed(write, repeat)
            base_load = timed(read, repeat)
        nbytes = n * block_bytes
        for op, secs, base in (("store", store, base_store), ("load", load, base_load)):
            rows.append({"tier": tier, "op": op, "block_kib": kib, "blocks": n, "bytes": nbytes,
                         "gb_per_s": round(nbytes / secs / 1e9, 3),
                         "baseline_gb_per_s": round(nbytes / base / 1e9, 3),
                         "ratio": round(base / secs, 3)})
        del t
    pool.close()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64, help="bytes moved per measurement, in MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--output", default="")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvbench-bw-") as folder:
        rows = [r for kib in BLOCK_KIB for r in measure(kib, args.mib, args.repeat, folder)]
    cols = list(rows[0])
    print("  ".join(f"{c:>17}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>17}" for c in cols))
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w", newline="") as f:
            w = csv.DictWriter(f, cols)
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
