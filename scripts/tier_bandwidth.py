"""Store and load bandwidth of the NumPy and torch pools' tiers (SPEC §11), as a ratio to a plain
copy of the same bytes (host) and to a sequential write / read of the same bytes to / from a file
(disk), in the same run, for blocks of 16 KiB to 1 MiB.

A store copies scattered device blocks (a random permutation of the pool) into consecutive tier
slots through the pool's own path (``PoolTiers._copy_down``, the tiers made by the pool's
``attach_tiers``), a load the reverse. Each repeat times the baseline and then the tier copy
(wall clock, alternately, so that load from other processes moves both alike); ratio = baseline
seconds / tier seconds (1.0: as fast as the plain copy), the median over ``--repeat``, by the
wall clock (``ratio``) and by this process's CPU clock (``cpu_ratio``: what the copy costs,
whatever else holds the cores). The disk
tier writes np.memmap pages and the baseline a file with write(), neither synced: both measure
what reaches the page cache. The goal: >= 0.8 for blocks of 256 KiB and up.

    python scripts/tier_bandwidth.py [--mib 32] [--repeat 15]    # results/tiers/bandwidth.{json,csv,png}
    python scripts/tier_bandwidth.py --draw                      # csv and png again from the json
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvbench.bench.tier_copies import tier_copies  # noqa: E402

BLOCK_KIB = (16, 32, 64, 128, 256, 512, 1024)
POOLS = ("numpy", "torch")
GOAL, GOAL_KIB = 0.8, 256
OUT = Path(__file__).resolve().parents[1] / "results" / "tiers"


def timed(fn) -> tuple[float, float]:
    """Wall and CPU seconds (this process: user and system, all threads) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def paired(base, subject, repeat: int) -> dict:
    """Median wall seconds of ``base`` and ``subject``, timed alternately after one untimed call
    of each (pages touched), and the medians of the repeats' ratios base / subject by the wall
    clock and by the CPU clock (on a loaded machine the wall clock counts the time other
    processes held the core; the CPU clock tells what the copy itself costs)."""
    base(), subject()
    pairs = [(timed(base), timed(subject)) for _ in range(repeat)]
    return {"base": float(np.median([b[0] for b, _ in pairs])),
            "secs": float(np.median([s[0] for _, s in pairs])),
            "ratio": float(np.median([b[0] / s[0] for b, s in pairs])),
            "cpu_ratio": float(np.median([b[1] / max(s[1], 1e-9) for b, s in pairs]))}


def measure(name: str, kib: int, total_mib: int, repeat: int, folder: str) -> list[dict]:
    tc = tier_copies(name, kib, total_mib << 20)
    flat, buf = tc.flat, np.empty_like(tc.flat)
    path = os.path.join(folder, f"seq-{name}-{kib}.bin")

    def copy():
        if isinstance(tc.pool.pool, np.ndarray):
            np.copyto(buf, flat)
        else:  # torch's own copy
            tc.pool.torch.from_numpy(buf).copy_(tc.pool.torch.from_numpy(flat))

    def write():
        with open(path, "wb") as f:
            f.write(memoryview(flat).cast("B"))

    def read():
        with open(path, "rb") as f:
            f.readinto(memoryview(buf).cast("B"))

    rows = []
    for tier in ("host", "disk"):
        bases = {"store": copy, "load": copy} if tier == "host" else {"store": write, "load": read}
        subjects = {"store": lambda: tc.store(tier), "load": lambda: tc.load(tier)}
        for op in ("store", "load"):
            m = paired(bases[op], subjects[op], repeat)
            rows.append({"pool": name, "tier": tier, "op": op, "block_kib": kib, "blocks": len(tc.blocks),
                         "bytes": tc.nbytes, "gb_per_s": round(tc.nbytes / m["secs"] / 1e9, 3),
                         "baseline": "copy" if tier == "host" else ("write" if op == "store" else "read"),
                         "baseline_gb_per_s": round(tc.nbytes / m["base"] / 1e9, 3),
                         "ratio": round(m["ratio"], 3), "cpu_ratio": round(m["cpu_ratio"], 3)})
    tc.close()
    return rows


def draw(rec: dict) -> None:
    """bandwidth.csv and bandwidth.png (ratio against block size, a line per pool, tier and op)."""
    import pandas as pd
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from kvbench.charts import finish
    df = pd.DataFrame(rec["rows"])
    df.to_csv(OUT / "bandwidth.csv", index=False)
    fig = Figure(figsize=(13, 3.8))
    FigureCanvasAgg(fig)
    panels = [("host", "ratio", "wall clock"), ("host", "cpu_ratio", "CPU clock"), ("disk", "ratio", "wall clock")]
    for i, (tier, col, clock) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        for (pool, op), g in df[df.tier == tier].groupby(["pool", "op"]):
            ax.plot(g.block_kib, g[col], marker="o", ls="-" if op == "store" else "--",
                    label=f"{pool} {op}")
        ax.axhline(GOAL, color="black", lw=0.8, ls=":")
        ax.axvline(GOAL_KIB, color="#999999", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(BLOCK_KIB, [str(k) for k in BLOCK_KIB])
        ax.set_xlabel("block (KiB)")
        ax.set_ylabel("tier / " + ("plain copy" if tier == "host" else "sequential write, read"))
        ax.set_title(f"{tier} tier, {clock} (goal {GOAL} from {GOAL_KIB} KiB)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    print(f"wrote {finish(fig, OUT / 'bandwidth.png', rec)}")


def main(argv=None) -> int:
    import tempfile

    from kvbench.bench import records
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=32, help="bytes moved per measurement, in MiB")
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (1: on a shared machine a parallel copy waits for "
                        "threads another process holds)")
    p.add_argument("--pool", action="append", choices=POOLS, help="default: both")
    p.add_argument("--draw", action="store_true", help="only redraw the csv and png from the json")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    if args.draw:
        draw(records.read(OUT / "bandwidth.json"))
        return 0
    if "torch" in (args.pool or POOLS):
        import torch
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvbench-bw-") as folder:
        rows = [r for name in args.pool or POOLS for kib in BLOCK_KIB
                for r in measure(name, kib, args.mib, args.repeat, folder)]
    cols = list(rows[0])
    print("  ".join(f"{c:>9}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>9}" for c in cols))
    if not args.no_write:
        OUT.mkdir(parents=True, exist_ok=True)
        rec = records.record("tier-bandwidth", rows, {"script": "scripts/tier_bandwidth.py",
                                                       "argv": sys.argv[1:] if argv is None else argv,
                                                       "threads": args.threads,
                                                       "load_average": os.getloadavg()})
        print(f"wrote {records.write(rec, OUT / 'bandwidth.json')}")
        draw(rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
