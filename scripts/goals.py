"""Issue 13's goals table, re-measured: every row a ratio of two timings taken side by side in
this run (interleaved, the fastest of a few trials, the median over repeats), or a wall time.

    .venv/bin/python scripts/goals.py                  # every row but the slow ones
    .venv/bin/python scripts/goals.py --slow           # also 10^6 operations and Mooncake
    .venv/bin/python scripts/goals.py --rows decode,quantize

Writes results/scaling/goals.json and prints the table (markdown) with the command of each row.
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

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import scaling  # noqa: E402

# The opt-in vLLM venv of docs/engines.md's recipe, beside the checkout (or beside its worktrees' folder).
VLLM_PY = next((p for p in (ROOT.parent / "vllm-env" / "bin" / "python",
                            ROOT.parents[1] / "vllm-env" / "bin" / "python") if p.exists()),
               ROOT.parent / "vllm-env" / "bin" / "python")
# The shared traces (README: KVBENCH_TRACES), by default beside the checkout.
MOONCAKE = Path(os.environ.get("KVBENCH_TRACES", ROOT.parent / "shared" / "traces")) \
    / "mooncake" / "synthetic_trace.jsonl"
REPEATS = 5


def _ratio(reference, subject, repeats=REPEATS, trials=5) -> float:
    from kvbench.bench.ratios import _fastest
    return statistics.median(r / s for r, s in (_fastest(reference, subject, trials)
                                                 for _ in range(repeats)))


def row_workloads(args):
    rows = scaling.workloads(3, "numpy")
    return {"measured": f"{rows[-1]['ratio']:.2f}x (the backend's own calls inside the checks: "
                        f"{rows[-1]['calls_ratio']:.2f}x its replay)", "goal": "<= 1.5x",
            "cmd": "scripts/scaling.py --workloads"}


def row_decode(args):
    rows = scaling.curve([10_000], 3, "numpy", Path(args.cache))
    r = rows[0]
    calls = scaling.measure("calls", Path(args.cache) / "decode-10000.jsonl", "numpy")["us_per_op"]
    return {"measured": f"{r['ratio']:.1f}x ({r['checker_us_per_op']:.0f} vs "
                        f"{r['backend_us_per_op']:.0f} us/op; the backend's own calls inside the "
                        f"check {calls:.0f} us/op, {calls / r['backend_us_per_op']:.1f}x)", "goal": "<= 2x",
            "cmd": "scripts/scaling.py --ops 10000", "rows": rows}


def row_million(args):
    rows = scaling.curve([10_000, 100_000, 1_000_000], 3, "numpy", Path(args.cache))
    scaling.write(rows, "curve")
    r = rows[-1]
    flat = ", ".join(f"{x['ratio']:.1f}x" for x in rows)
    return {"measured": f"{r['checker_seconds'] / 60:.1f} min, {r['checker_peak_rss_mb']:.0f} MB "
                        f"(checker / backend at 1e4, 1e5, 1e6: {flat})",
            "goal": "< 10 min, < 500 MB, flat", "cmd": "scripts/scaling.py", "rows": rows}


def row_mooncake(args):
    cmd = [str(ROOT / ".venv" / "bin" / "kvbench"), "serve", "--trace", str(MOONCAKE), "--format",
           "mooncake", "--backend", "numpy", "--check", "--store-kv", "--model", "tiny",
           "--budget", "65536", "--quiet", "--output", "/tmp/kvbench-goals-mooncake.json"]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.mooncake_timeout)
    wall = time.perf_counter() - t0
    verdict = [line for line in out.stdout.splitlines() if "replay of" in line]
    return {"measured": f"{wall / 60:.1f} min ({verdict[-1].strip() if verdict else out.stderr[-300:]})",
            "goal": "< 10 min", "cmd": " ".join(["kvbench"] + cmd[1:])}


def row_decode_vs_object(args):
    from kvbench.bench.gates import bench_common
    common = bench_common()
    out = {}
    for batch in (1, 256, 1024):
        ref, seqs = common.decode_batch("object", batch, store_kv=False)
        sub, _ = common.decode_batch("numpy", batch, store_kv=False)
        ones = [1] * batch
        out[batch] = _ratio(lambda i: ref.append(seqs, ones, None, step=i + 1),
                            lambda i: sub.append(seqs, ones, None, step=i + 1), trials=7)
    return {"measured": " / ".join(f"{out[b]:.2f}" for b in out), "goal": ">= 1 / >= 10 / >= 20",
            "cmd": "scripts/goals.py --rows decode_vs_object"}


def row_alloc(args):
    if VLLM_PY.exists():
        js = "/tmp/kvbench-goals-vllm.json"
        subprocess.run([str(VLLM_PY), "-m", "pytest", "benchmarks/test_bench_vllm.py", "-k", "alloc",
                        "--benchmark-enable", f"--benchmark-json={js}", "-q"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
        try:
            bench = json.load(open(js))["benchmarks"]
        except (OSError, KeyError, ValueError) as e:
            return {"measured": f"vLLM run failed: {e}", "goal": ">= 1 / >= 20", "cmd": "-"}
        got = {b["params"].get("n") or b["name"]: b["extra_info"].get("numpy_vs_vllm_pool")
               for b in bench if "numpy" in b["name"] and "numpy_vs_vllm_pool" in b.get("extra_info", {})}
        return {"measured": " / ".join(f"n={k}: {v:.2f}" for k, v in got.items()),
                "goal": ">= 1 / >= 20 (n = 1 / 256)",
                "cmd": "../vllm-env/bin/python -m pytest benchmarks/test_bench_vllm.py -k alloc --benchmark-enable"}
    return {"measured": "vLLM not installed here", "goal": ">= 1 / >= 20", "cmd": "-"}


def row_gather(args):
    from kvbench.bench.gates import bench_common
    common = bench_common()
    tokens = 128 * 1024  # 128 MiB in the suite's 1 KiB-per-token model
    b = common.interleaved_pair("numpy", tokens)
    src = common.zeros_kv(tokens) + np.float16(1)
    dst = np.empty_like(src)
    fresh = _ratio(lambda i: np.copy(src), lambda i: np.asarray(b.gather(0)), repeats=3, trials=3)
    try:
        reused = _ratio(lambda i: np.copyto(dst, src), lambda i: b.gather(0, out=dst), repeats=3, trials=3)
    except TypeError:
        reused = float("nan")
    b = None  # free the pool before the next row
    return {"measured": f"{fresh:.2f} (fresh output vs np.copy), {reused:.2f} (into a reused "
                        f"buffer vs np.copyto)", "goal": ">= 0.8",
            "cmd": "scripts/goals.py --rows gather"}


def row_quantize(args):
    from impls import quant_numpy
    from kvbench import quant as Q
    x = np.random.default_rng(0).standard_normal((16 * 2**20 // 4 // 128, 128), dtype=np.float32)
    dst = np.empty_like(x)
    got = {}
    for name, scheme in (("int8 per-channel", Q.QuantScheme(8)),
                         ("int8 per-token", Q.QuantScheme(8, False, "token")),
                         ("int4 group-32", Q.QuantScheme(4, False, "group", group_size=32))):
        qt = quant_numpy.quantize(x, scheme)
        got[name] = (_ratio(lambda i: np.copyto(dst, x), lambda i: quant_numpy.quantize(x, scheme, out=qt)),
                     _ratio(lambda i: np.copyto(dst, x),
                            lambda i: quant_numpy.quantize(x, scheme, out=qt, compiled=False), repeats=3))
    return {"measured": " / ".join(f"{a:.2f}" for a, _ in got.values())
            + " (NumPy steps alone: " + " / ".join(f"{b:.2f}" for _, b in got.values()) + ")",
            "goal": ">= 0.5 / >= 0.4 / >= 0.25", "cmd": "scripts/goals.py --rows quantize"}


ROWS = {
    "workloads": ("checker / backend replay, content checked, committed workloads", row_workloads),
    "decode": ("checker / backend replay, 10^4-op decode trace, content checked", row_decode),
    "million": ("10^6-op trace checked with content: wall time, RSS (2 cores)", row_million),
    "mooncake": ("whole Mooncake trace through the serving simulation, checked", row_mooncake),
    "decode_vs_object": ("NumPy decode step / object model, batch 1 / 256 / 1024, ledger only",
                         row_decode_vs_object),
    "alloc": ("NumPy alloc+free / vLLM pool, n = 1 / 256", row_alloc),
    "gather": ("gather of 128 MiB vs a copy", row_gather),
    "quantize": ("quantize vs copy: int8 per-channel / per-token / int4 group-32", row_quantize),
}
SLOW = ("million", "mooncake")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--slow", action="store_true", help="also " + ", ".join(SLOW))
    p.add_argument("--cache", default="/tmp/kvbench-scaling")
    p.add_argument("--mooncake-timeout", type=int, default=3600)
    args = p.parse_args()
    names = args.rows.split(",") if args.rows else [n for n in ROWS if args.slow or n not in SLOW]
    if "decode" in names and "million" in names:
        names.remove("decode")  # the curve measures 10^4 too
    results = {}
    for n in names:
        print(f"--- {ROWS[n][0]}", flush=True)
        results[n] = {"measure": ROWS[n][0], **ROWS[n][1](args)}
        print(f"    {results[n]['measured']}", flush=True)
    print("\n| measure | measured | goal | command |\n|---|---|---|---|")
    for r in results.values():
        print(f"| {r['measure']} | {r['measured']} | {r['goal']} | `{r['cmd']}` |")
    out = scaling.OUT / "goals.json"
    old = json.loads(out.read_text()) if out.exists() else {}
    old.update(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(old, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
