"""Run a grid on a Ray cluster of several nodes on this machine and hold its records against those
the local pool stored for the same grid and commit.

    .venv/bin/python scripts/sweep_local_cluster.py GRID [--local-store results/sweeps/store]
        [--ray-store /tmp/kvbench-ray-store] [--nodes 2]

The cluster (ray.cluster_utils.Cluster: a head that runs no cell, NODES worker nodes of one CPU)
is started and stopped here; the sweep is `kvbench sweep GRID --executor ray --address ...`, as a
user would run it. Records are compared column by column, the RUN_COLUMNS of kvbench.bench.sweep
(timings, worker pid and cores) left out.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("grid")
    ap.add_argument("--local-store", default="results/sweeps/store")
    ap.add_argument("--ray-store", default=tempfile.mkdtemp(prefix="kvbench-ray-store-"))
    ap.add_argument("--nodes", type=int, default=2)
    args = ap.parse_args()
    import pandas as pd
    from ray.cluster_utils import Cluster

    from kvbench.bench import sweep
    from kvbench.bench.grid import load_grid
    from kvbench.bench.store import Store

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        t0 = time.perf_counter()
        rc = subprocess.call([sys.executable, "-m", "kvbench.cli", "sweep", args.grid, "--executor", "ray",
                              "--address", cluster.address, "--store", args.ray_store, "--no-charts",
                              "--progress-interval", "10"])
        print(f"ray sweep: exit {rc}, {time.perf_counter() - t0:.1f} s")
    finally:
        cluster.shutdown()
    name = load_grid(args.grid).name

    def cells(url):
        df, _ = Store(url).cells(name)
        return df.drop(columns=[c for c in sweep.RUN_COLUMNS if c in df]).sort_values("cell_id") \
            .reset_index(drop=True)
    local, remote = cells(args.local_store), cells(args.ray_store)
    pd.testing.assert_frame_equal(local, remote)
    print(f"{len(local)} records identical on the local pool and on Ray ({local.shape[1]} columns; "
          f"left out: {', '.join(sweep.RUN_COLUMNS)})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
