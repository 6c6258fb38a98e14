"""Checking cost per operation against the size of the pool, for one fixed trace: it must be
flat (SPEC §10's structure checks follow the blocks an operation moves; the whole pool is swept
after operations 1, 2, 4, 8, ... and the last only).

    .venv/bin/python scripts/pool_scaling.py                      # 2^14 .. 2^18 blocks, numpy
    .venv/bin/python scripts/pool_scaling.py --requests 500 --repeats 1 --out /tmp/x.csv

The trace is a prefix-cache replay (kvbench prefix's: every request prefilled with its block
hashes, then freed) of synthetic conversations: ``--requests`` requests, each a prefix of one
of 30 documents of 64 blocks and 2 blocks of its own, 16-token blocks. It holds fewer distinct
blocks than the smallest pool, so every size does the same work and only the pool differs. Each
size is checked ``--repeats`` times in this process, sizes interleaved; the median per operation
and its ratio to the smallest pool go to results/scaling/pool.csv, whose first line is the
command that wrote it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvbench.analyses import prefix  # noqa: E402
from kvbench.bench.records import commit_info, machine_info  # noqa: E402
from kvbench.checking.checker import check  # noqa: E402
from kvbench.contract import registry  # noqa: E402
from kvbench.contract.formulas import get_model  # noqa: E402
from kvbench.contract.protocol import CacheConfig  # noqa: E402
from kvbench.traces.loaders import Request  # noqa: E402

B = 16
DOCUMENTS, DOCUMENT_BLOCKS, OWN_BLOCKS = 30, 64, 2


def conversations(requests: int, seed: int = 0) -> list[Request]:
    """Request i reads the first 8..64 blocks of document i * 7 % 30 (a hash per document and
    depth), then 2 blocks of its own."""
    import numpy as np
    rng = np.random.default_rng(seed)
    out = []
    for i in range(requests):
        doc, depth = i * 7 % DOCUMENTS, int(rng.integers(8, DOCUMENT_BLOCKS + 1))
        hashes = [doc * DOCUMENT_BLOCKS + d for d in range(depth)]
        hashes += [DOCUMENTS * DOCUMENT_BLOCKS + i * OWN_BLOCKS + k for k in range(OWN_BLOCKS)]
        out.append(Request(arrival=float(i), prompt_tokens=len(hashes) * B, output_tokens=1,
                           block_hashes=tuple(hashes), hash_block_size=B))
    return out


def seconds(trace, num_blocks: int, backend: str) -> float:
    cfg = CacheConfig(model=get_model("tiny"), block_size=B, num_blocks=num_blocks, store_kv=False,
                      prefix_caching=True)
    b = registry.create(backend, cfg)
    t0 = time.perf_counter()
    v = check(trace, b, gather="none")
    elapsed = time.perf_counter() - t0
    if not v.valid:
        raise SystemExit(f"{backend} at {num_blocks} blocks: {v.divergence or v.error}")
    return elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1000, help="requests (2 operations each)")
    p.add_argument("--log2-blocks", default="14,15,16,17,18", help="pool sizes, as powers of 2")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--out", default=str(ROOT / "results" / "scaling" / "pool.csv"))
    args = p.parse_args(argv)
    trace = prefix.cache_trace(conversations(args.requests), B)
    sizes = [1 << int(k) for k in args.log2_blocks.split(",")]
    distinct = prefix.unique_blocks(trace)
    if distinct > sizes[0]:
        raise SystemExit(f"the trace holds {distinct} distinct blocks, more than {sizes[0]}")
    runs = {n: [] for n in sizes}
    for _ in range(args.repeats):
        for n in sizes:  # interleaved: each size sees the machine of the moment
            runs[n].append(seconds(trace, n, args.backend) / len(trace.ops) * 1e6)
            print(f"{n:>8} blocks: {runs[n][-1]:8.1f} us/op", flush=True)
    base = statistics.median(runs[sizes[0]])
    info, machine = commit_info(), machine_info()
    command = " ".join(["python", "scripts/pool_scaling.py", *(sys.argv[1:] if argv is None else argv)])
    lines = [f"# {command}"
             f"  (commit {info.get('commit', '?')[:12]}{' dirty' if info.get('dirty') else ''}, "
             f"{machine['platform']}, {machine.get('cpus', '?')} cpus)",
             "backend,num_blocks,ops,distinct_blocks,repeats,median_us_per_op,ratio_to_smallest"]
    for n in sizes:
        med = statistics.median(runs[n])
        lines.append(f"{args.backend},{n},{len(trace.ops)},{distinct},{args.repeats},{med:.1f},"
                     f"{med / base:.2f}")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
