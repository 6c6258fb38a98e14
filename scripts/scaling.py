"""The scaling curve of the checker: per-operation cost and peak RSS of the backend's own replay
and of the checker (K/V content checked) on decode traces of 10^4, 10^5 and 10^6 operations.

    .venv/bin/python scripts/scaling.py                          # 1e4 1e5 1e6, numpy
    .venv/bin/python scripts/scaling.py --ops 10000 --repeats 5  # one size, the median of 5
    .venv/bin/python scripts/scaling.py --workloads              # the committed workloads
    .venv/bin/python scripts/scaling.py --breakdown              # where the checker's time goes,
                                                                 # and the backend's calls in it
    .venv/bin/python scripts/scaling.py --draw                   # curve.csv, curve.png again
    .venv/bin/python scripts/scaling.py --stages checker --limit 100000  # peak RSS stage by stage

Every measurement runs in a fresh process (its peak RSS is its own: imports, trace, pool and
checker); the backend and the checker alternate, and the ratio checker / backend is taken per
repeat, then the median. Traces are generated once into --cache (continuous batching of up to 32
sequences, Alpaca lengths, tiny model, a budget with room for the peak: no eviction). Results go
to results/scaling/curve.json (with the machine, commit and load average), curve.csv and
curve.png (with a provenance line); results/scaling/README.md tells what they show.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "results" / "scaling"
# This tree's kvbench first (an editable install would import another checkout's). Not the
# scripts folder: its coverage.py would shadow the coverage package numba tries to import (numba
# then fails to import, and the NumPy pool's compiled steps go unmeasured).
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "scripts"]
from kvbench.provenance import peak_rss_mb  # noqa: E402


def make_trace(ops: int, path: Path) -> None:
    from kvbench.traces import format as T
    from kvbench.traces import generators as G
    from kvbench.traces.builder import peak_blocks

    # ~3.8 operations per request at batch 32 with Alpaca outputs: a prefill, a free, and its
    # share of the decode steps.
    requests = max(8, int(ops / 3.8))
    t = G.decode_streams(0, num_requests=requests, max_batch=32, arrival_rate=2, law="alpaca")
    t.header.settings = {"block_size": 16, "num_blocks": peak_blocks(t.ops, 16) + 64, "model": "tiny"}
    t.name = path.stem
    T.save(t, str(path))


def child(mode: str, path: str) -> dict:
    """One measurement in this process: load the trace, replay it (backend) or check it."""
    t0 = time.perf_counter()
    from kvbench.bench.gates import bench_common
    from kvbench.checking.driver import replay
    from kvbench.analyses import suite
    from kvbench.checking.checker import check
    from kvbench.contract import registry
    from kvbench.traces import format as T
    trace = T.load(path)
    load_s = time.perf_counter() - t0
    backend_name = os.environ.get("KVBENCH_SCALING_BACKEND", "numpy")
    cfg = suite.config_for(trace, policy=None)
    backend = registry.create(backend_name, cfg)
    inside = None
    t1 = time.perf_counter()
    if mode == "backend":
        common = bench_common()
        replay(backend, trace, common.kv_buffer(trace, cfg))
        status = "replayed"
    elif mode == "oracle":  # the oracle alone: what expectations cached per trace would save at most
        from kvbench.checking.checker import oracle_for
        check(trace, None, model=oracle_for(trace, backend))
        status = "replayed"
    else:
        inside = _time_calls(backend) if mode == "calls" else None
        v = check(trace, backend, gather=mode.removeprefix("checker-") if "-" in mode else "touched")
        status = v.status if v.valid is not False else f"FAIL {v.divergence}"
    seconds = time.perf_counter() - t1
    if inside is not None:  # the backend's own calls, not the check around them
        calls = {name: round(s / len(trace.ops) * 1e6, 2) for name, s in sorted(inside.items())}
        seconds = sum(inside.values())
    return {"mode": mode, "backend": backend_name, "ops": len(trace.ops), "seconds": seconds,
            **({"us_per_op_by_call": calls} if inside is not None else {}),
            "us_per_op": seconds / len(trace.ops) * 1e6, "load_seconds": load_s,
            "trace_bytes": getattr(trace.ops, "nbytes", None), "status": status,
            "peak_rss_mb": peak_rss_mb()}


# The protocol's calls a check makes (SPEC §5, §10-13): what a checker making them per operation pays
# at least, whatever it does between them.
BACKEND_CALLS = ("prefill", "append", "fork", "free", "accept", "chunked_prefill", "preempt",
                 "resume", "swap_out", "swap_in", "ledger", "gather", "gather_ranges",
                 "block_state", "read_state", "close")


def _time_calls(backend) -> dict:
    """Time the backend's protocol calls on this instance: {name: seconds inside}."""
    inside = {}
    clock = time.perf_counter

    def timed(name, fn):
        def call(*a, **kw):
            t = clock()
            try:
                return fn(*a, **kw)
            finally:
                inside[name] = inside.get(name, 0.0) + clock() - t
        return call

    for name in BACKEND_CALLS:
        fn = getattr(backend, name, None)
        if callable(fn):
            setattr(backend, name, timed(name, fn))
    return inside


class _Enough(BaseException):
    """Stops a staged check after its --limit operations (not an Exception: the checker's own
    handler would take it for the harness's failure)."""


def stages(mode: str, path: str, limit: int | None) -> list:
    """Peak RSS (VmHWM) and RSS now after each stage of one measurement in this process:
    imports, loading (parsing, then validation), the settings, the pool, the K/V buffer (backend)
    and every 10^5 operations of the replay or the check, stopped after ``limit`` operations."""
    rows = []

    def mark(stage):
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
        rows.append({"stage": stage, "peak_rss_mb": round(peak_rss_mb(), 1),
                     "rss_mb": round(now, 1), "seconds": round(time.perf_counter() - t0, 1)})
        print(f"{stage:34} peak {rows[-1]['peak_rss_mb']:7.1f} MB  now {rows[-1]['rss_mb']:7.1f} MB  "
              f"{rows[-1]['seconds']:7.1f} s", file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    mark("start")
    from kvbench.analyses import suite
    from kvbench.bench.gates import bench_common
    from kvbench.checking.checker import check
    from kvbench.checking.driver import replay
    from kvbench.contract import registry
    from kvbench.traces import columns as C
    from kvbench.traces import format as T
    mark("imports")
    first_invalid = C.first_invalid

    def validate(table):
        mark("parsed into columns")
        bad = first_invalid(table)
        mark("validated (columns.first_invalid)")
        return bad

    C.first_invalid = validate
    trace = T.load(path)
    C.first_invalid = first_invalid
    mark(f"loaded: {trace.ops.nbytes / 2**20:.0f} MiB of columns")
    cfg = suite.config_for(trace, policy=None)
    mark("settings (config_for)")
    backend = registry.create(os.environ.get("KVBENCH_SCALING_BACKEND", "numpy"), cfg)
    mark("pool made (registry.create)")

    class Progress:
        n = 0

        def update(self, k=1, *_):
            self.n += k
            if self.n % 100_000 == 0:
                mark(f"{self.n:,} operations")
            if limit and self.n >= limit:
                raise _Enough

    progress = Progress()
    try:
        if mode == "backend":
            kv = bench_common().kv_buffer(trace, cfg)
            mark("K/V buffer (kv_buffer)")
            replay(backend, trace, kv, lambda op: progress.update())
        else:
            check(trace, backend, progress=progress)
    except _Enough:
        pass
    mark(f"end ({progress.n:,} operations)")
    return rows


def measure(mode: str, path: Path, backend: str) -> dict:
    env = dict(os.environ, KVBENCH_SCALING_BACKEND=backend)
    out = subprocess.run([sys.executable, __file__, "--child", mode, str(path)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def curve(sizes, repeats, backend, cache: Path) -> list:
    rows = []
    cache.mkdir(parents=True, exist_ok=True)
    for n in sizes:
        path = cache / f"decode-{n}.jsonl"
        if not path.exists():
            print(f"generating {path} ...", flush=True)
            make_trace(n, path)
        reps = repeats if n <= 10_000 else 1
        pairs = []
        for _ in range(reps):  # alternate: both see the machine of the moment
            b = measure("backend", path, backend)
            c = measure("checker", path, backend)
            pairs.append((b, c))
            print(f"{b['ops']:>9} ops  backend {b['us_per_op']:8.1f} us/op {b['peak_rss_mb']:7.0f} MB   "
                  f"checker {c['us_per_op']:8.1f} us/op {c['peak_rss_mb']:7.0f} MB  {c['status']}", flush=True)
        med = lambda k, i: statistics.median(p[i][k] for p in pairs)  # noqa: E731
        rows.append({"ops": pairs[0][0]["ops"], "repeats": reps, "backend": backend,
                     "backend_us_per_op": med("us_per_op", 0), "checker_us_per_op": med("us_per_op", 1),
                     "ratio": statistics.median(c["seconds"] / b["seconds"] for b, c in pairs),
                     "checker_seconds": med("seconds", 1), "load_seconds": med("load_seconds", 1),
                     "backend_peak_rss_mb": med("peak_rss_mb", 0), "checker_peak_rss_mb": med("peak_rss_mb", 1),
                     "trace_bytes": pairs[0][1]["trace_bytes"], "status": pairs[-1][1]["status"]})
    return rows


def breakdown(ops: int, repeats: int, backend: str, cache: Path) -> list:
    """Where the checker's time goes on one decode trace: the backend's replay alone, the oracle
    alone (its expected ledgers, victims and hits: all that depends on the trace and settings
    only), the checker with the ledger only (the oracle, the ledger comparison, the identities),
    with K/V content read back (touched), and the backend's own calls inside that check (``calls``:
    the operations and the ledger, block_state and gather reads the checker makes, by call): each
    a fresh process, alternated, the median of ``repeats``."""
    path = cache / f"decode-{ops}.jsonl"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        make_trace(ops, path)
    modes = ("backend", "oracle", "checker-none", "checker", "calls")
    runs = {m: [] for m in modes}
    for _ in range(repeats):
        for m in modes:
            runs[m].append(measure(m, path, backend))
    rows = [{"mode": m, "ops": runs[m][0]["ops"], "backend": backend, "repeats": repeats,
             "us_per_op": statistics.median(r["us_per_op"] for r in runs[m])} for m in modes]
    names = sorted({n for r in runs["calls"] for n in r["us_per_op_by_call"]})
    rows[-1]["us_per_op_by_call"] = {n: statistics.median(r["us_per_op_by_call"].get(n, 0.0) for r in runs["calls"])
                                     for n in names}
    for r in rows:
        print(f"{r['mode']:14} {r['us_per_op']:8.1f} us/op  "
              f"({r['us_per_op'] / rows[0]['us_per_op']:.1f}x the backend)", flush=True)
    print("  the backend's calls inside the check, us/op: " + ", ".join(
        f"{n} {v:.1f}" for n, v in rows[-1]["us_per_op_by_call"].items()), flush=True)
    return rows


def workloads(repeats: int, backend: str) -> list:
    """Checker / backend replay over every committed workload (each tenant mix under lru, lfu
    and fair), K/V written and checked: interleaved in this process, the median of ``repeats``
    of each, summed over the workloads; and the backend's calls inside a check (``calls_ms``:
    what a checker reading the backend after each operation pays at least)."""
    import gc

    from kvbench.bench.gates import bench_common
    from kvbench.analyses import suite
    from kvbench.checking.checker import check
    from kvbench.checking.driver import replay
    from kvbench.contract import registry
    common = bench_common()
    rows = []
    for path in suite.committed_workloads():
        trace = suite.load_traces([path])[0]
        if trace.header.tiers:  # the backend's replay alone does not drive tiers (SPEC §11)
            print(f"skipped {trace.name}: the replay without oracle does not drive its tiers")
            continue
        for policy in suite.policies_for(trace, "auto"):
            cfg = suite.config_for(trace, policy=policy)
            kv = common.kv_buffer(trace, cfg)
            b_s, c_s, i_s = [], [], []
            for _ in range(repeats):
                gc.collect()
                b = registry.create(backend, cfg)
                t0 = time.perf_counter()
                replay(b, trace, kv)
                b_s.append(time.perf_counter() - t0)
                b = registry.create(backend, cfg)
                t0 = time.perf_counter()
                v = check(trace, b)
                c_s.append(time.perf_counter() - t0)
                b = registry.create(backend, cfg)
                inside = _time_calls(b)
                check(trace, b)
                i_s.append(sum(inside.values()))
            rows.append({"workload": trace.name, "policy": policy or "-", "ops": len(trace.ops),
                         "backend_ms": statistics.median(b_s) * 1e3,
                         "checker_ms": statistics.median(c_s) * 1e3,
                         "calls_ms": statistics.median(i_s) * 1e3, "status": v.status})
            print(f"{trace.name:24} {policy or '-':5} backend {rows[-1]['backend_ms']:8.1f} ms  "
                  f"checker {rows[-1]['checker_ms']:8.1f} ms  the backend's calls in it "
                  f"{rows[-1]['calls_ms']:8.1f} ms  {v.status}", flush=True)
    total_b, total_c, total_i = (sum(r[k] for r in rows) for k in ("backend_ms", "checker_ms", "calls_ms"))
    print(f"all committed workloads: checker / backend = {total_c / total_b:.2f} "
          f"({total_c:.0f} ms / {total_b:.0f} ms); the backend's calls inside the checks / its "
          f"replay = {total_i / total_b:.2f}")
    rows.append({"workload": "ALL", "backend_ms": total_b, "checker_ms": total_c, "calls_ms": total_i,
                 "ratio": total_c / total_b, "calls_ratio": total_i / total_b})
    return rows


def write(rows, kind: str) -> None:
    from kvbench.bench import records
    OUT.mkdir(parents=True, exist_ok=True)
    rec = records.record(f"scaling-{kind}", rows, {"script": "scripts/scaling.py", "argv": sys.argv[1:],
                                                   "loadavg": os.getloadavg()})
    print(f"wrote {records.write(rec, OUT / f'{kind}.json')}")
    if kind == "curve":
        draw(rec)


def draw(rec: dict) -> None:
    """curve.csv and curve.png (per-operation cost and peak RSS against the trace's length,
    backend and checker) from a curve record."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd

    from kvbench.charts import finish
    df = pd.DataFrame(rec["rows"])
    df.to_csv(OUT / "curve.csv", index=False)
    fig, (cost, rss) = plt.subplots(1, 2, figsize=(10, 4))
    for who, colour in (("backend", "#4c72b0"), ("checker", "#c44e52")):
        cost.plot(df["ops"], df[f"{who}_us_per_op"], "o-", color=colour, label=who)
        rss.plot(df["ops"], df[f"{who}_peak_rss_mb"], "o-", color=colour, label=who)
    rss.axhline(500, color="#555555", ls="--", lw=1, label="goal: 500 MB")
    for ax, title in ((cost, "time per operation (us)"), (rss, "peak RSS of the process (MB)")):
        ax.set_xscale("log")
        ax.set_xlabel("operations in the decode trace")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.legend()
    load = rec["params"].get("loadavg")
    fig.suptitle(f"{rec['rows'][0]['backend']}: K/V content checked vs the backend's own replay"
                 + (f" (load average {', '.join(f'{x:.1f}' for x in load)})" if load else ""))
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    print(f"wrote {finish(fig, OUT / 'curve.png', rec)}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", type=int, action="append", help="trace sizes (default 1e4, 1e5, 1e6)")
    p.add_argument("--repeats", type=int, default=3, help="alternations at <= 1e4 operations")
    p.add_argument("--backend", default="numpy")
    p.add_argument("--cache", default="/tmp/kvbench-scaling", help="where generated traces are kept")
    p.add_argument("--child", nargs=2, metavar=("MODE", "TRACE"), help=argparse.SUPPRESS)
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--workloads", action="store_true",
                   help="checker / backend replay over the committed workloads instead")
    p.add_argument("--breakdown", action="store_true",
                   help="backend / checker ledger-only / checker with K/V at the first --ops size")
    p.add_argument("--stages", choices=("backend", "checker"),
                   help="peak RSS after each stage of one run in this process (the first --ops size)")
    p.add_argument("--limit", type=int, help="with --stages: stop after this many operations")
    p.add_argument("--draw", action="store_true",
                   help="only redraw curve.csv and curve.png from results/scaling/curve.json")
    args = p.parse_args()
    if args.draw:
        from kvbench.bench import records
        draw(records.read(OUT / "curve.json"))
        return 0
    if args.child:
        print(json.dumps(child(*args.child)))
        return 0
    if args.stages:
        path = Path(args.cache) / f"decode-{(args.ops or [1_000_000])[0]}.jsonl"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            make_trace((args.ops or [1_000_000])[0], path)
        print(json.dumps(stages(args.stages, str(path), args.limit)))
        return 0
    if args.breakdown:
        rows = breakdown((args.ops or [10_000])[0], args.repeats, args.backend, Path(args.cache))
        if not args.no_write:
            write(rows, "breakdown")
        return 0
    if args.workloads:
        rows = workloads(args.repeats, args.backend)
        if not args.no_write:
            write(rows, "workloads")
        return 0
    rows = curve(args.ops or [10_000, 100_000, 1_000_000], args.repeats, args.backend, Path(args.cache))
    if not args.no_write:
        write(rows, "curve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
