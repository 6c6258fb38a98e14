"""Stores and loads through the NumPy pool's tiers (SPEC §11): scattered device blocks copied into
consecutive host (arrays) or disk (np.memmap) slots and back, by block size, beside a plain copy
of the same bytes (scripts/tier_bandwidth.py reports the ratios)."""
import shutil
import tempfile
import types

import numpy as np

BLOCK_KIB = [16, 256, 1024]
TOTAL_BYTES = 32 << 20


class TierCopy:
    version = "1"
    params = [["host", "disk"], ["store", "load", "plain_copy"], BLOCK_KIB]
    param_names = ["tier", "op", "block_kib"]
    repeat = (3, 10, 10.0)

    def setup(self, tier, op, kib):
        try:
            from impls.numpy_tiers import NumpyTiers, _TierSlots
            from kvbench.traces.tier_ops import TierSpec
        except ImportError:
            raise NotImplementedError("no tiers at this commit")
        n = TOTAL_BYTES // (kib << 10)
        pool = np.random.default_rng(0).integers(0, 255, size=(n, kib << 10), dtype=np.uint8)
        self.folder = tempfile.mkdtemp(prefix="kvbench-asv-tiers-")
        self.tier = _TierSlots(TierSpec(tier, n), [pool], self.folder)
        self.owner = types.SimpleNamespace(pool=pool, _storage=lambda: [pool])
        self.blocks = np.random.default_rng(1).permutation(n).astype(np.intp)
        self.slots = np.arange(n)
        self.copy_down, self.copy_up = NumpyTiers._copy_down, NumpyTiers._copy_up
        self.out = np.empty_like(pool)
        self.copy_down(self.owner, self.tier, self.blocks, self.slots)  # pages touched once

    def teardown(self, *params):
        shutil.rmtree(self.folder, ignore_errors=True)

    def time_transfer(self, tier, op, kib):
        if op == "store":
            self.copy_down(self.owner, self.tier, self.blocks, self.slots)
        elif op == "load":
            self.copy_up(self.owner, self.tier, self.slots, self.blocks)
        else:
            np.copyto(self.out, self.owner.pool)
