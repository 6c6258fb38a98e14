"""The Mooncake prefix-cache replay through a backend under the checker, at several cache sizes.

`kvbench prefix` stops at a backend's first divergence; this records it instead (an engine that
evicts differently from kvbench's rule is a finding, not an error), beside the hits each side
counted. One row per cache size: status, the first divergence, the backend's and the oracle's
hit blocks, refusals.

    /work/vllm-env/bin/python scripts/engine_prefix.py vllm-kvmanager --out results/engines/vllm-kvmanager
    /work/sglang-env/bin/python scripts/engine_prefix.py sglang-radix --out results/engines/sglang-radix
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import pandas as pd

from kvbench.analyses import prefix
from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig, OutOfMemory, Prompt
from kvbench.traces.format import Prefill
from kvbench.traces.loaders import load_requests

MOONCAKE = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces")) \
    / "mooncake" / "synthetic_trace.jsonl"


def rows(backend: str, trace, sizes) -> list[dict]:
    out = []
    for n in sizes:
        cfg = CacheConfig(model=get_model("tiny"), block_size=trace.header.settings["block_size"],
                          num_blocks=n, store_kv=False, prefix_caching=True)
        be = registry.create(backend, cfg)
        v = check(trace, be, gather="none")
        oracle = check(trace, None, model=_oracle(cfg, be.capabilities), gather="none")
        out.append({"backend": backend, "block_size": cfg.block_size, "cache_blocks": n,
                    "status": v.status, "ops": v.ops, "of_ops": len(trace.ops),
                    "hit_blocks": v.final_ledger.get("prefix_hit_blocks"),
                    "oracle_hit_blocks": oracle.final_ledger["prefix_hit_blocks"],
                    "hashed_blocks": prefix.hashed_blocks(trace), "refused": v.ooms,
                    "divergence": str(v.divergence) if v.divergence else "",
                    # Past a divergence: the hits the engine finds under its own rules, unchecked.
                    "engine_hit_blocks": v.final_ledger.get("prefix_hit_blocks") if v.valid
                    else free_run(backend, cfg, trace)})
        print(out[-1])
    return out


def free_run(backend: str, cfg, trace) -> int:
    """The whole trace through the backend alone (prefills and frees), its own hit count."""
    be = registry.create(backend, cfg)
    live = set()
    for op in trace.ops:
        if isinstance(op, Prefill):
            try:
                be.prefill(op.seq, Prompt(op.tokens, op.tenant, block_hashes=op.block_hashes),
                           step=op.step)
                live.add(op.seq)
            except OutOfMemory:
                pass
        elif op.seq in live:
            be.free(op.seq, step=op.step)
            live.discard(op.seq)
    return be.ledger().prefix_hit_blocks


def _oracle(cfg, caps):
    from kvbench.model.oracle import Oracle
    return Oracle(dataclasses.replace(cfg), capabilities=caps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("backend")
    p.add_argument("--trace", default=str(MOONCAKE))
    p.add_argument("--max-requests", type=int, default=500)
    p.add_argument("--block-size", type=int, action="append", help="512 (the file's) and/or a divisor")
    p.add_argument("--out", help="folder for mooncake<N>-prefix.csv")
    args = p.parse_args(argv)
    found = []
    for bs in args.block_size or [512, 16]:
        requests = load_requests(args.trace, "mooncake")
        trace = prefix.cache_trace(requests[:args.max_requests], bs)
        unbounded = prefix.unique_blocks(trace)
        sizes = sorted({max(1, unbounded // 8), max(1, unbounded // 4), max(1, unbounded // 2), unbounded})
        found += rows(args.backend, trace, sizes)
    if args.out:
        path = Path(args.out) / f"mooncake{args.max_requests}-prefix.csv"
        pd.DataFrame(found).to_csv(path, index=False)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
