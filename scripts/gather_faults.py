"""A 128 MiB gather against a copy of the same bytes, each call timed with the minor page faults it
took: into a fresh output (np.copy against gather) and into a reused one (np.copyto against
gather(out=)). What `scripts/goals.py --rows gather` reads as a ratio, taken apart.

    .venv/bin/python scripts/gather_faults.py [--trials 7] [--rounds 2]
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, trials: int) -> tuple[float, list]:
    """Fastest seconds of ``trials`` calls, and each call's minor faults."""
    best, faults = float("inf"), []
    for _ in range(trials):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        del out  # a fresh output's pages go back before the next call
    return best, faults


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    from kvbench.bench.gates import bench_common
    common = bench_common()
    tokens = 128 * 1024  # 128 MiB in the suite's 1 KiB-per-token model
    pool = common.interleaved_pair("numpy", tokens)
    src = common.zeros_kv(tokens) + np.float16(1)
    dst = np.empty_like(src)
    calls = {"np.copy (fresh output)": lambda: np.copy(src),
             "gather (fresh output)": lambda: pool.gather(0),
             "np.copyto (reused buffer)": lambda: np.copyto(dst, src),
             "gather(out=) (reused buffer)": lambda: pool.gather(0, out=dst)}
    for _ in range(args.rounds):
        for name, fn in calls.items():
            best, faults = timed(fn, args.trials)
            print(f"{name:30} fastest {best * 1e3:7.1f} ms  minor faults per call {sorted(set(faults))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
