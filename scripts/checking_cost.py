"""What checking costs per operation as the pool grows: one held-out-sized trace through the checker
for each backend at two pool sizes, the same trace and everything else the same.

The trace: the Mooncake synthetic trace (../shared/traces/mooncake), every request a prefill of its
prompt (its hash ids, at the file's 512-token blocks), its output in ``--appends`` appends, and a
free, the requests overlapping (request i's k-th operation at slot i + k), so several are live at
once: 3,993 requests x 6 operations = 23,958 operations. For a backend whose lower tier is the
engine's (vllm-offload) the tier is the cache that grows: each request a load, a store of its full
blocks to a tier as large as the pool, their two dones, an append and a free (6 operations too). Ledger only (store_kv off): the cost is
the checker's and the backend's bookkeeping, which is what should not grow with the pool.

Per backend and size: seconds per operation of the whole check (wall and this process's CPU
time: on a shared machine the CPU time is the steadier) and of the backend's own calls
(``verdict.backend_seconds``, wall), the median of ``--repeats``; and the ratios of the largest
size to the smallest. Each engine runs in its own env:

    PYTHONPATH=$PWD nice -n 10 /work/vllm-env/bin/python scripts/checking_cost.py vllm-kvmanager vllm-blockpool vllm-offload
    PYTHONPATH=$PWD nice -n 10 /work/sglang-env/bin/python scripts/checking_cost.py sglang sglang-radix
    PYTHONPATH=$PWD nice -n 10 python scripts/checking_cost.py numpy --out results/engines/checking-cost

``--profile`` prints cProfile's top functions of one check instead (what grows with the pool).
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import time
from importlib import metadata
from pathlib import Path

from kvbench.checking.checker import check
from kvbench.contract import registry
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.format import Header, Trace, validate
from kvbench.traces.loaders import MOONCAKE_BLOCK_SIZE, load_requests, rehash_requests
from kvbench.traces.ops import Append, Done, Free, Load, Prefill, Store
from kvbench.traces.tier_ops import TierSpec

# ../shared/traces beside the checkout (a worktree's is one level further down), or KVBENCH_TRACES.
MOONCAKE = Path(os.environ.get("KVBENCH_TRACES") or next(
    (p / "shared" / "traces" for p in Path(__file__).resolve().parents[1:4] if (p / "shared" / "traces").is_dir()),
    Path("../shared/traces"))) / "mooncake" / "synthetic_trace.jsonl"
TIERED = {"vllm-offload"}  # backends whose lower tiers are the engine's: the trace names a tier


def serving_trace(requests, block_size: int, appends: int, tier_blocks: int | None = None) -> Trace:
    """Each request a prefill, ``appends`` appends of its output (at least a token each) and a
    free; request i's k-th operation at slot i + k, the older request first within a slot.
    With a tier of ``tier_blocks``: a load (a prefill served from the tier after the device's
    hit) and its done, a store of every full block and its done, one append, the free."""
    reqs = rehash_requests(requests, block_size)
    n_appends = 1 if tier_blocks else appends
    slots: dict = {}
    for i, r in enumerate(reqs):
        out = max(r.output_tokens, n_appends)
        parts = [out // n_appends + (k < out % n_appends) for k in range(n_appends)]
        if tier_blocks:
            events = [("load", r), ("done", 2 * i), ("store", 2 * i + 1), ("done", 2 * i + 1)]
        else:
            events = [("prefill", r)]
        events += [("append", p) for p in parts] + [("free", None)]
        for k, e in enumerate(events):
            slots.setdefault(i + k, []).append((i, e))
    ops = []
    for t in sorted(slots):
        for i, (kind, x) in sorted(slots[t], key=lambda e: e[0]):
            step = len(ops)
            if kind == "prefill":
                ops.append(Prefill(step, i, x.tenant, x.prompt_tokens, tuple(x.block_hashes)))
            elif kind == "load":
                ops.append(Load(step, i, x.tenant, x.prompt_tokens, tuple(x.block_hashes), id=2 * i))
            elif kind == "store":
                ops.append(Store(step, x, i, "host"))
            elif kind == "done":
                ops.append(Done(step, x))
            elif kind == "append":
                ops.append(Append(step, (i,), (x,)))
            else:
                ops.append(Free(step, i))
    tiers = (TierSpec("host", tier_blocks),) if tier_blocks else ()
    header = Header(family="serving", generator="scripts/checking_cost.py",
                    params={"requests": len(reqs), "appends": n_appends},
                    settings={"block_size": block_size, "prefix_caching": True}, tiers=tiers)
    return validate(Trace(header, ops, name=f"mooncake-serving{len(reqs)}"))


def config(block_size: int, num_blocks: int) -> CacheConfig:
    return CacheConfig(model=get_model("tiny"), block_size=block_size, num_blocks=num_blocks,
                       store_kv=False, prefix_caching=True)


def one(backend: str, trace: Trace, num_blocks: int) -> dict:
    be = registry.create(backend, config(trace.header.settings["block_size"], num_blocks))
    t0, c0 = time.perf_counter(), time.process_time()
    v = check(trace, be, gather="none")
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"status": v.status, "ops": v.ops, "seconds": wall, "cpu_seconds": cpu,
            "backend_seconds": v.backend_seconds,
            "divergence": str(v.divergence) if v.divergence else "", "refused": v.ooms,
            "evictions": v.evictions, "hit_blocks": v.final_ledger.get("prefix_hit_blocks")}


def measure(backend: str, requests, args) -> dict:
    warm = serving_trace(requests[:50], args.block_size, args.appends,
                         1 << min(args.sizes) if backend in TIERED else None)
    one(backend, warm, 1 << min(args.sizes))  # imports and first calls, outside the timings
    rows = {}
    for exp in args.sizes:
        n = 1 << exp
        trace = serving_trace(requests, args.block_size, args.appends,
                              n if backend in TIERED else None)
        runs = [one(backend, trace, n) for _ in range(args.repeats)]
        ops = runs[0]["ops"]
        rows[exp] = {"num_blocks": n, "status": runs[0]["status"], "ops": ops,
                     "of_ops": len(trace.ops), "refused": runs[0]["refused"],
                     "evictions": runs[0]["evictions"], "hit_blocks": runs[0]["hit_blocks"],
                     "divergence": runs[0]["divergence"][:300],
                     "ms_per_op": 1e3 * statistics.median(r["seconds"] for r in runs) / max(1, ops),
                     "cpu_ms_per_op": 1e3 * statistics.median(r["cpu_seconds"] for r in runs) / max(1, ops),
                     "backend_ms_per_op": 1e3 * statistics.median(r["backend_seconds"] for r in runs)
                     / max(1, ops), "repeats": [r["seconds"] for r in runs],
                     "cpu_repeats": [r["cpu_seconds"] for r in runs]}
        print(backend, exp, {k: v for k, v in rows[exp].items() if k != "divergence"}, flush=True)
    lo, hi = rows[min(args.sizes)], rows[max(args.sizes)]
    return {"backend": backend, "sizes": rows,
            "ratio": hi["ms_per_op"] / lo["ms_per_op"],
            "cpu_ratio": hi["cpu_ms_per_op"] / lo["cpu_ms_per_op"],
            "backend_ratio": hi["backend_ms_per_op"] / lo["backend_ms_per_op"]
            if lo["backend_ms_per_op"] else None}


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in ("vllm", "sglang", "torch", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("backends", nargs="+")
    p.add_argument("--trace", default=str(MOONCAKE))
    p.add_argument("--block-size", type=int, default=MOONCAKE_BLOCK_SIZE)
    p.add_argument("--appends", type=int, default=4, help="appends per request (its output split)")
    p.add_argument("--requests", type=int, default=None, help="the first N requests only")
    p.add_argument("--sizes", type=int, nargs="+", default=[14, 17], help="log2 of num_blocks")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", type=int, metavar="LOG2", help="profile one check at this size")
    p.add_argument("--out", help="folder: checking-cost-<backend>.json each")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch's intra-op threads (an engine's tensor ops on the CPU): on a shared "
                        "machine more threads than free cores make each op wait for the others")
    args = p.parse_args(argv)
    try:
        import torch
        torch.set_num_threads(args.torch_threads)
    except ImportError:
        pass
    requests = load_requests(args.trace, "mooncake")[:args.requests]
    for backend in args.backends:
        if args.profile is not None:
            n = 1 << args.profile
            trace = serving_trace(requests, args.block_size, args.appends,
                                  n if backend in TIERED else None)
            prof = cProfile.Profile()
            prof.enable()
            print(one(backend, trace, n))
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
            continue
        row = measure(backend, requests, args)
        row.update(command=f"scripts/checking_cost.py {backend} --sizes {' '.join(map(str, args.sizes))} "
                           f"--repeats {args.repeats} --torch-threads {args.torch_threads}"
                           + (f" --requests {args.requests}" if args.requests else ""),
                   versions=versions(), machine=f"{platform.machine()}, {os.cpu_count()} cores",
                   loadavg=os.getloadavg())
        print(json.dumps({k: row[k] for k in ("backend", "ratio", "cpu_ratio", "backend_ratio")}), flush=True)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            path = Path(args.out) / f"checking-cost-{backend}.json"
            path.write_text(json.dumps(row, indent=1) + "\n")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
