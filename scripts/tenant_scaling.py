"""Checking cost against the number of tenants: the same operations spread over 10^3, 10^4 and
10^5 tenants, each size in a fresh process (wall time and peak RSS), the NumPy backend with the
checker's series on (what `kvbench run` keeps per operation and per tenant).

    python scripts/tenant_scaling.py [--ops 200000] [--tenants 1000,10000,100000] [--out FILE.csv]

Every trace has the same shape: sequence i (tenant i mod T) is prefilled with 1 + i mod 40
tokens, gets one token, and is freed 8 sequences later, so at most 9 sequences and 9 tenants live
at once whatever T is. The cost must follow the operations, not the tenants ever seen.
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIVE = 8


def trace_of(ops: int, tenants: int):
    from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate
    out, step, seq = [], 0, 0
    while len(out) + 3 <= ops:
        out.append(Prefill(step, seq, f"t{seq % tenants}", 1 + seq % 40))
        out.append(Append(step + 1, (seq,), (1,)))
        step += 2
        if seq >= LIVE:
            out.append(Free(step, seq - LIVE))
            step += 1
        seq += 1
    return validate(Trace(Header("tenant-scaling", generator="scripts/tenant_scaling.py"), out,
                          name=f"tenants-{tenants}"))


def one(ops: int, tenants: int) -> dict:
    from kvbench.checking.checker import check
    from kvbench.contract import registry
    from kvbench.contract.protocol import CacheConfig
    from kvbench.provenance import peak_rss_mb
    trace = trace_of(ops, tenants)
    backend = registry.create("numpy", CacheConfig(num_blocks=64, store_kv=False))
    t0 = time.perf_counter()
    v = check(trace, backend, gather="none", series=True)
    seconds = time.perf_counter() - t0
    assert v.valid, v.divergence
    return {"tenants": tenants, "ops": len(trace.ops), "seconds": round(seconds, 2),
            "us_per_op": round(seconds / len(trace.ops) * 1e6, 1),
            "peak_rss_mb": round(peak_rss_mb(), 1),
            "tenants_seen": len(v.series.tenants)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=200_000)
    p.add_argument("--tenants", default="1000,10000,100000")
    p.add_argument("--out", help="CSV file for the rows")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one size, JSON out
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.ops, args.one)))
        return 0
    rows = []
    for t in (int(x) for x in args.tenants.split(",")):
        got = subprocess.run([sys.executable, __file__, "--ops", str(args.ops), "--one", str(t)],
                             cwd=ROOT, capture_output=True, text=True, check=True)
        rows.append(json.loads(got.stdout.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            f.write(f"# python scripts/tenant_scaling.py --ops {args.ops} --tenants {args.tenants}\n")
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
