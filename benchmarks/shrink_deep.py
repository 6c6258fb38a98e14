"""`kvbench shrink` on a deep failure: a generated ~10^5-operation trace, first failing past step 50,000.

    .venv/bin/python benchmarks/shrink_deep.py [--out DIR] [--max-seconds S]

The trace is a tenant mix (``tenant_mixes``, seed 0): 28,800 requests over 160 blocks of 16. A
"steady" tenant of short requests (8-48 prompt, 8-40 output tokens) runs from the start and fits
the budget on its own, so nothing is evicted; a "late" tenant of long requests (200-400 + 50-200
tokens) joins at request 17,856, and its first requests force the first evictions, past step
50,000. The backend is fault (f) of the catalogue (tests/impls/test_faults.py): LRU that breaks a tie
on last access towards the larger sequence id, under ``--policy lru``. The checker passes every
operation until the first eviction with a tie.

The script writes the trace to DIR (default results/scratch/shrink/), runs `kvbench shrink` on it
with the default budgets, and prints the sizes before and after, the attempts and the time.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # impls, for the catalogue's fault

from kvbench.cli import main  # noqa: E402
from kvbench.search.shrink import DEFAULT_MAX_SECONDS  # noqa: E402
from kvbench.traces.format import load, save  # noqa: E402
from kvbench.traces.generators import generate  # noqa: E402

REQUESTS = 28_800
TENANTS = [
    {"name": "steady", "weight": 1, "law": {"name": "uniform", "prompt": [8, 48], "output": [8, 40]}},
    {"name": "late", "weight": 1, "law": {"name": "uniform", "prompt": [200, 400], "output": [50, 200]},
     "start": int(REQUESTS * 0.62)},
]
FAULT = "impls.faults:LruTiesWrongWay"


def deep_trace():
    return generate("tenant_mixes", 0, tenants=TENANTS, num_requests=REQUESTS, max_prompt=400,
                    max_output=200, concurrency=8, max_batch=4, decode_chunk=8, num_blocks=160)


def run(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "results" / "scratch" / "shrink"))
    p.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "deep.jsonl"
    trace = deep_trace()
    trace.name = "deep"
    save(trace, str(path))
    t0 = time.perf_counter()
    code = main(["shrink", str(path), "--backend", FAULT, "--policy", "lru",
                 "--max-seconds", str(args.max_seconds)])
    wall = time.perf_counter() - t0
    if code != 1:
        print(f"expected a failure to shrink, `kvbench shrink` exited {code}")
        return 1
    shrunk = load(str(out / "deep.min.jsonl"))
    src = shrunk.header.params["source"]
    print(f"before: {src['ops']} ops, first divergence at step {src['step']}; after: {len(shrunk)} ops "
          f"(block_size {shrunk.header.settings['block_size']}, num_blocks "
          f"{shrunk.header.settings['num_blocks']}); {src['attempts']} attempts, {src['seconds']:.0f} s "
          f"shrinking, {wall:.0f} s with loading ({src['stopped']})")
    return 0


if __name__ == "__main__":
    sys.exit(run())
