"""Stores and loads through the NumPy and torch pools' tiers (SPEC §11): scattered device blocks
copied into consecutive host (arrays) or disk (np.memmap) slots and back, by block size, beside a
plain copy of the same bytes (scripts/tier_bandwidth.py reports the ratios). The fixture is
kvbench.bench.tier_copies, the one the script and the ratio gate use."""
import numpy as np

BLOCK_KIB = [16, 256, 1024]
TOTAL_BYTES = 32 << 20


class TierCopy:
    version = "2"  # 1: the NumPy tier alone, on bare arrays; 2: each pool's own tiers and copies
    params = [["numpy", "torch"], ["host", "disk"], ["store", "load", "plain_copy"], BLOCK_KIB]
    param_names = ["pool", "tier", "op", "block_kib"]
    repeat = (3, 10, 10.0)

    def setup(self, pool, tier, op, kib):
        try:
            from kvbench.bench.tier_copies import tier_copies
        except ImportError:
            raise NotImplementedError("no tier copies fixture at this commit")
        if pool == "torch":
            import importlib.util
            if importlib.util.find_spec("torch") is None:
                raise NotImplementedError("torch is not installed")
        self.tc = tier_copies(pool, kib, TOTAL_BYTES)
        self.out = np.empty_like(self.tc.flat)
        self.tc.store(tier)  # pages touched once

    def teardown(self, *params):
        tc = self.__dict__.pop("tc", None)  # None where setup said n/a
        if tc is not None:
            tc.close()

    def time_transfer(self, pool, tier, op, kib):
        if op == "store":
            self.tc.store(tier)
        elif op == "load":
            self.tc.load(tier)
        else:
            np.copyto(self.out, self.tc.flat)
