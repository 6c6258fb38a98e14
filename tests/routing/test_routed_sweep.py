"""Routed cells of `kvbench sweep` (backend "route:POLICY", setting `replicas`): run by the sweep's
executors into the results store, refused where they make no sense."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.bench import grid as grids
from kvbench.bench import sweep
from kvbench.bench.store import Store

ROOT = Path(__file__).resolve().parents[2]

GRID = f"""
name = "routed"
backends = ["route:longest-prefix", "route:round-robin"]
[[traces]]
path = "{ROOT / 'workloads' / 'prefix-reuse.jsonl'}"
[settings]
replicas = [1, 4]
budget = ["27", "64"]
store_kv = false
"""


def test_a_routed_grid_runs_into_the_store(tmp_path):
    (tmp_path / "g.toml").write_text(GRID)
    g = grids.load_grid(tmp_path / "g.toml")
    store = Store(tmp_path / "store")
    run = sweep.run_sweep(g, store, workers=1, progress={"enabled": False})
    assert run.summary == {"pass": 8}  # 2 policies x 2 replica counts x 2 budgets
    df = store.read("routed")
    assert set(df["router"]) == {"longest-prefix", "round-robin"}
    assert (df["available"] >= df["captured"]).all() and (df["captured"] >= df["delivered"]).all()
    one = df[df["replicas"] == 1]
    assert (one["available"] == one["captured"]).all()
    # longest prefix over 4 replicas captures all that is available; round robin does not
    four = df[(df["replicas"] == 4)].set_index(["router", "budget"])
    assert four.loc[("longest-prefix", "64"), "captured"] == four.loc[("longest-prefix", "64"), "available"]
    assert four.loc[("round-robin", "64"), "captured"] < four.loc[("round-robin", "64"), "available"]


@pytest.mark.parametrize("text, message", [
    ('backends = ["route:nearest"]\n', "unknown routing policy 'nearest'"),
    ('backends = ["numpy"]\n', "'replicas' is a setting of routed cells"),
])
def test_bad_routed_grids_are_refused(tmp_path, text, message):
    body = GRID.split("[[traces]]", 1)[1]
    (tmp_path / "g.toml").write_text(f'name = "routed"\n{text}[[traces]]{body}')
    g = grids.load_grid(tmp_path / "g.toml")
    with pytest.raises(grids.GridError, match=message):
        grids.check_cells(g, *grids.expand(g, "code"))
