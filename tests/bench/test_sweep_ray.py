"""`kvbench sweep --executor ray` on a real Ray cluster of several nodes on this machine
(ray.cluster_utils.Cluster, as Ray's own tests make them), started and stopped here: the same
records as the local pool, and a worker node killed mid-sweep loses no finished cell."""
from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pandas as pd
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

from kvbench.bench import grid as grids  # noqa: E402
from kvbench.bench import sweep  # noqa: E402
from kvbench.bench.store import Store  # noqa: E402

GRID = """
name = "ray"
backends = ["numpy", "contiguous-oracle"]
seeds = [0, 1]
[[traces]]
workload = "fork-beam"
[[traces]]
family = "decode_streams"
params = { num_requests = 12, law = "alpaca", max_prompt = 100, max_output = 60 }
[settings]
block_size = [8, 16]
budget = "16KiB"
store_kv = false
gather = "none"
"""
# fork-beam (a file): 2 block sizes x 2 backends = 4; decode_streams: 2 seeds x 2 x 2 = 8
CELLS = 12


@pytest.fixture
def cluster():
    """A head that runs no cell and two worker nodes of one CPU each."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [c.add_node(num_cpus=1) for _ in range(2)]
    c.wait_for_nodes()
    yield c, nodes
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def descendants(pid: int) -> list[int]:
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def load(tmp_path, text=GRID):
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return grids.load_grid(path)


def cells_without_timings(store: Store) -> pd.DataFrame:
    df = store.read("ray")
    return df.drop(columns=[c for c in sweep.RUN_COLUMNS if c in df.columns]).sort_values("cell_id") \
        .reset_index(drop=True)


def test_ray_and_the_local_pool_store_identical_records(tmp_path, cluster):
    c, _ = cluster
    g = load(tmp_path)
    local, remote = Store(tmp_path / "local"), Store(tmp_path / "ray")
    assert sweep.run_sweep(g, local, workers=2, progress={"enabled": False}).summary == {"pass": CELLS}
    run = sweep.run_sweep(g, remote, executor="ray", address=c.address, progress={"enabled": False})
    assert run.summary == {"pass": CELLS} and not run.lost
    a, b = cells_without_timings(local), cells_without_timings(remote)
    assert len(a) == CELLS
    pd.testing.assert_frame_equal(a, b)
    # Written by the Ray workers themselves: none of the driver's pid.
    assert os.getpid() not in set(remote.read("ray")["worker_pid"])


def test_a_node_killed_mid_sweep_loses_no_finished_cell_and_the_sweep_resumes(tmp_path, cluster):
    c, nodes = cluster
    # Cells of about half a second, so that the kill lands in the middle of one.
    text = GRID.replace("seeds = [0, 1]", "seeds = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]") \
               .replace('[[traces]]\nworkload = "fork-beam"\n', "").replace("num_requests = 12", "num_requests = 160")
    g = load(tmp_path, text)
    total = 10 * 2 * 2  # 10 seeds x 2 block sizes x 2 backends
    store = Store(tmp_path / "store")
    ray.init(address=c.address)
    result = {}
    runner = threading.Thread(target=lambda: result.update(run=sweep.run_sweep(
        g, store, executor="ray", max_retries=0, progress={"enabled": False})))
    runner.start()
    deadline = time.monotonic() + 300
    while len(store.done("ray")) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    before = {p: store.read("ray").set_index("cell_id").loc[p, "started"] for p in store.done("ray")}
    # The node dies at once, its workers with it (as when a machine is lost); a raylet killed
    # alone leaves its worker a moment to finish the cell it runs.
    raylet = nodes[0].all_processes["raylet"][0].process.pid
    for pid in descendants(raylet):
        os.kill(pid, signal.SIGKILL)
    c.remove_node(nodes[0], allow_graceful=False)
    runner.join(timeout=600)
    run = result["run"]
    after = store.read("ray").set_index("cell_id")
    # Every cell finished before the kill is still there, as it was.
    assert set(before) <= set(after.index)
    assert all(after.loc[k, "started"] == v for k, v in before.items())
    # The cells the dead node held were lost (not recorded), the others finished on the live node.
    # (A lost cell may still have written its record if the node died between the write and the
    # reply: then it is stored and not run again.)
    # (On a loaded machine the kill may land between two of its cells: then nothing is lost.)
    assert {c.id for c in run.cells} == set(after.index) | {cell.id for cell, _ in run.lost}
    assert len(run.cells) == total
    # The same sweep again runs exactly the missing cells, on the node that is left.
    again = sweep.run_sweep(g, store, executor="ray", progress={"enabled": False})
    assert again.skipped == len(after) and sum(again.summary.values()) == total - len(after)
    assert not again.lost and len(store.done("ray")) == total
