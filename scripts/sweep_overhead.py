"""Per-cell overhead of the Ray executor against the local pool, on cells of about a second.

    .venv/bin/python scripts/sweep_overhead.py [--cells 20] [--repeats 3] [--requests 320]

The same grid (one decode_streams trace per seed, checked with its K/V) runs alternately on the
local pool (2 workers) and on a local Ray cluster of two 1-CPU worker nodes (the head runs no
cell), each time into a fresh store. Printed per executor: the sweep's wall time (executor start
included), the median time a cell took inside its worker, and Ray's overhead per cell slot:
(wall_ray - wall_local) / (cells / 2), with the median over repeats.
"""
from __future__ import annotations

import argparse
import statistics
from datetime import datetime
import tempfile
from pathlib import Path

GRID = """
name = "overhead"
backends = ["numpy"]
seeds = {seeds}
[[traces]]
family = "decode_streams"
params = {{ num_requests = {requests}, law = "alpaca", max_prompt = 100, max_output = 60 }}
[settings]
block_size = 16
budget = "64KiB"
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=320)
    args = ap.parse_args()
    import ray
    from ray.cluster_utils import Cluster

    from kvbench.bench import grid as grids
    from kvbench.bench import sweep
    from kvbench.bench.store import Store

    tmp = Path(tempfile.mkdtemp(prefix="kvbench-overhead-"))
    (tmp / "grid.toml").write_text(GRID.format(seeds=list(range(args.cells)), requests=args.requests))
    g = grids.load_grid(tmp / "grid.toml")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    walls, cells, gaps = ({"local": [], "ray": []} for _ in range(3))
    try:
        for r in range(args.repeats):
            for executor, opts in (("local", {"workers": 2}), ("ray", {})):
                store = Store(tmp / f"{executor}-{r}")
                run = sweep.run_sweep(g, store, executor=executor, progress={"enabled": False}, **opts)
                assert run.summary == {"pass": args.cells}, run.summary
                walls[executor].append(run.wall_s)
                df = store.read("overhead")
                df["start"] = df["started"].map(lambda t: datetime.fromisoformat(t).timestamp())
                df = df.sort_values(["worker_pid", "start"])
                end = (df["start"] + df["wall_s"]).groupby(df["worker_pid"]).shift()
                cells[executor].append(float(df["wall_s"].median()))
                gaps[executor].append(float((df["start"] - end).dropna().median()))
                print(f"repeat {r} {executor:5}: sweep {run.wall_s:6.2f} s, median cell {cells[executor][-1]:.3f} s, "
                      f"overhead {gaps[executor][-1] * 1e3:.0f} ms per cell", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    med = {k: {e: statistics.median(v[e]) for e in v} for k, v in
           (("wall", walls), ("cell", cells), ("gap", gaps))}
    print(f"medians over {args.repeats} repeats of {args.cells} cells on 2 workers:")
    for e in ("local", "ray"):
        print(f"  {e:5}: sweep {med['wall'][e]:.2f} s, cell {med['cell'][e]:.3f} s, overhead "
              f"{med['gap'][e] * 1e3:.0f} ms per cell ({med['gap'][e] / med['cell'][e]:.1%} of a cell)")
    extra = med["gap"]["ray"] - med["gap"]["local"]
    print(f"ray against local: {extra * 1e3:+.0f} ms per cell = {extra / med['cell']['local']:+.1%} of a "
          f"{med['cell']['local']:.2f} s cell; cell time ray/local {med['cell']['ray'] / med['cell']['local']:.3f}")


if __name__ == "__main__":
    main()
