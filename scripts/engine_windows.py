"""Hybrid traces through a backend under the checker, over sliding windows, group layouts and
block sizes: one row per run (status, the first divergence), written as CSV.

The committed hybrid workload has one model (sliding(32) and full at B = 8); this replays the
same generator (kvbench.traces.hybrid.hybrid_windows) on models whose windows lie below, at and
across block boundaries, with a full group, without one (Mistral-7B v0.1's kind), and with two
windows, prefix caching on and off.

    /work/vllm-env/bin/python scripts/engine_windows.py vllm-kvmanager \\
        --out results/engines/vllm-kvmanager/windows.csv
"""
from __future__ import annotations

import argparse
import itertools

import pandas as pd

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import ModelSpec, hybrid_groups
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.hybrid import hybrid_windows

WINDOWS = (1, 5, 9, 16, 17, 40)
BLOCK_SIZES = (4, 8, 16)
LAYOUTS = {"mix": lambda w: (w, None), "sliding-only": lambda w: (w,),
           "two-windows": lambda w: (w, 2 * w + 3, None)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("backend")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--out", required=True, help="CSV file")
    args = ap.parse_args(argv)
    entry = registry.resolve(args.backend)
    rows = []
    for w, (layout, pattern_of), B, seed, caching in itertools.product(
            WINDOWS, LAYOUTS.items(), BLOCK_SIZES, range(args.seeds), (True, False)):
        pattern = pattern_of(w)
        layers = 2 * len(pattern)
        model = ModelSpec(f"{layout}-{w}", layers=layers, kv_heads=1, head_dim=4,
                          groups=hybrid_groups(layers, pattern))
        trace = hybrid_windows(seed, num_requests=args.requests, block_size=B, budget_fraction=0.5)
        # The generator sizes its budget for two groups; scale it to this model's.
        blocks = trace.header.settings["num_blocks"] * len(pattern) // 2 + 8
        cfg = CacheConfig(model=model, block_size=B, num_blocks=blocks, store_kv=False,
                          prefix_caching=caching)
        v = check(trace, entry.create(cfg))
        rows.append(dict(window=w, layout=layout, groups=" ".join(g.kind for g in model.kv_groups),
                         block_size=B, seed=seed, prefix_caching=caching, num_blocks=blocks,
                         status={True: "pass", False: "FAIL", None: "n/a"}[v.valid], ops=v.ops,
                         divergence=str(v.divergence or v.error or v.not_applicable or "")[:300]))
        print(rows[-1]["status"], w, layout, B, seed, caching, rows[-1]["divergence"][:120], flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False)
    print(df.groupby(["window", "prefix_caching"]).status.value_counts().unstack(fill_value=0))


if __name__ == "__main__":
    main()
