"""Routed sweeps over N, cache sizes and policies on a real Ray cluster of two worker nodes on this
machine (ray.cluster_utils.Cluster, as tests/bench/test_sweep_ray.py makes it), run by `kvbench
sweep --executor ray`: the same records as the local pool, and the charts against N and against
the cache size, read back from the PNG files the sweep put in the store, show each stored figure
at its place in its line's colour."""
from __future__ import annotations

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
from matplotlib.colors import to_rgb

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
from ray.cluster_utils import Cluster  # noqa: E402

from kvbench.bench import grid as grids  # noqa: E402
from kvbench.bench import sweep  # noqa: E402
from kvbench.bench.store import Store  # noqa: E402
from kvbench.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

GRID = f"""
name = "routed"
backends = ["route:longest-prefix", "route:round-robin"]
[[traces]]
path = "{ROOT / 'workloads' / 'prefix-reuse.jsonl'}"
[settings]
replicas = [1, 2, 4]
budget = ["27", "64"]
store_kv = false
[[charts]]
kind = "lines"
x = "replicas"
metric = "captured_frac"
hue = "router"
[[charts]]
kind = "lines"
x = "budget"
metric = "available_frac"
hue = "replicas"
"""
CELLS = 2 * 3 * 2  # policies x N x cache sizes


@pytest.fixture
def cluster():
    """A head that runs no cell and two worker nodes of one CPU each."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    if ray.is_initialized():
        ray.shutdown()
    c.shutdown()


def without_timings(df: pd.DataFrame) -> pd.DataFrame:
    timed = [*sweep.RUN_COLUMNS, "seconds"]  # the cell's and the routed run's own
    return df.drop(columns=[c for c in timed if c in df.columns]).sort_values("cell_id") \
        .reset_index(drop=True)


def drawn(png: Path, lines: list) -> list:
    """For each line (its values at x positions 0, 1, ...; line k drawn in colour Ck, later lines
    over earlier ones), how many pixels of its colour lie within 3 pixels of each point's place.
    The place comes from the axes' frame found in the picture (its black spines) and matplotlib's
    default margins (5 % of the data's span on each side)."""
    img = mpimg.imread(png)[..., :3]
    dark = img.max(axis=2) < 0.35  # the spines; the lines' colours all have a channel above
    cols, rows = dark.sum(axis=0), dark.sum(axis=1)
    c, r = np.flatnonzero(cols > 0.6 * cols.max()), np.flatnonzero(rows > 0.6 * rows.max())
    left, right, top, bottom = c[0], c[-1], r[0], r[-1]
    lo, hi = min(map(min, lines)), max(map(max, lines))
    out = []
    for k, values in enumerate(lines):
        n, counts = len(values), []
        for i, v in enumerate(values):
            x = round(left + (i + 0.05 * (n - 1)) / (1.1 * (n - 1)) * (right - left))
            y = round(bottom - (v - lo + 0.05 * (hi - lo)) / (1.1 * (hi - lo)) * (bottom - top))
            window = img[y - 3:y + 4, x - 3:x + 4]
            counts.append(int((np.abs(window - to_rgb(f"C{k}")).max(axis=2) < 0.1).sum()))
        out.append(counts)
    return out


def assert_shown(png: Path, table: pd.DataFrame) -> None:
    """Each row of ``table`` (a line, its columns the x positions in order) drawn at its places,
    but where a later line passes through the same point (it covers it)."""
    lines = table.to_numpy(dtype=float).tolist()
    span = max(map(max, lines)) - min(map(min, lines))
    assert span > 0
    counts = drawn(png, lines)
    for k, values in enumerate(lines):
        for i, v in enumerate(values):
            covered = any(abs(later[i] - v) < 0.02 * span for later in lines[k + 1:])
            assert covered or counts[k][i] >= 10, (png.name, table.index[k], table.columns[i], counts)


def test_a_routed_sweep_on_ray_stores_what_the_local_pool_does_and_charts_it(tmp_path, cluster, capsys):
    path = tmp_path / "g.toml"
    path.write_text(GRID)
    local = Store(tmp_path / "local")
    assert sweep.run_sweep(grids.load_grid(path), local, workers=2,
                           progress={"enabled": False}).summary == {"pass": CELLS}
    store = tmp_path / "ray"
    assert main(["sweep", str(path), "--store", str(store), "--executor", "ray",
                 "--address", cluster.address, "--quiet"]) == 0
    assert f"ran {CELLS} ({CELLS} pass)" in capsys.readouterr().out
    df = Store(store).read("routed")
    pd.testing.assert_frame_equal(without_timings(local.read("routed")), without_timings(df))
    assert sorted(set(df["replicas"])) == [1, 2, 4] and set(df["budget"]) == {"27", "64"}
    assert (df["available"] >= df["captured"]).all() and (df["captured"] >= df["delivered"]).all()
    one = df[df["replicas"] == 1]
    assert (one["available"] == one["captured"]).all()  # one replica: nothing to route wrong

    charts = store / "_charts" / "routed"
    by_n = df.groupby(["router", "replicas"])["captured_frac"].mean().unstack()
    # longest prefix captures more than round robin at 4 replicas (the lines apart there)
    assert by_n.loc["longest-prefix", 4] > by_n.loc["round-robin", 4]
    assert_shown(charts / "lines-captured_frac-by-replicas.png", by_n)
    by_cache = df.groupby(["replicas", "budget"])["available_frac"].mean().unstack()
    assert_shown(charts / "lines-available_frac-by-budget.png", by_cache)
