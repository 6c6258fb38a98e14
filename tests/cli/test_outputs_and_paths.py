"""Where commands write (issue 45): a name read from a file never leads a write out of its
folder (refused with the file and line, exit 2); a chart is the same bytes each time it is drawn;
the commands' default outputs are folders git ignores; `serve --offload` runs as the README shows
it; what loading accepts is what docs/trace-format.md and docs/tiers-and-lifecycles.md say."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvbench.bench.store import Store
from kvbench.cli import main
from kvbench.traces.format import TraceError, loads, to_csv
from test_cli_errors import refused

ROOT = Path(__file__).resolve().parents[2]


# --- names read from files ---------------------------------------------------------------------

GRID = """name = "{name}"
backends = ["numpy"]
[[traces]]
workload = "fork-beam"
[settings]
block_size = 16
budget = "8KiB"
policy = "none"
store_kv = false
gather = "none"
[[charts]]
kind = "lines"
x = "budget"
metric = "peak_blocks"
name = "{chart}"
"""


@pytest.mark.parametrize("name, chart, line, why", [
    ("../../x", "c", 1, "climbs out of its folder"),
    ("sub/../../x", "c", 1, "climbs out of its folder"),
    ("/tmp/x", "c", 1, "is an absolute path"),
    ("g", "../../../../x", 15, "climbs out of its folder"),
    ("g", "/x", 15, "is an absolute path"),
])
def test_a_grid_name_or_chart_name_that_leaves_its_folder_is_refused_with_file_and_line(
        tmp_path, capsys, name, chart, line, why):
    grid = tmp_path / "deep" / "er" / "g.toml"
    grid.parent.mkdir(parents=True)
    grid.write_text(GRID.format(name=name, chart=chart))
    store = tmp_path / "deep" / "er" / "store"
    err = refused(["sweep", str(grid), "--store", str(store), "--quiet"], capsys, names=f"{grid}:{line}: ")
    assert why in err
    assert not store.exists()  # refused before any cell ran
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deep", "er", "g.toml"]


def test_a_chart_name_through_a_symbolic_link_out_of_the_charts_folder_is_refused(tmp_path, capsys):
    grid = tmp_path / "g.toml"
    grid.write_text(GRID.format(name="g", chart="link/c"))
    charts, outside = tmp_path / "charts", tmp_path / "outside"
    charts.mkdir()
    outside.mkdir()
    (charts / "link").symlink_to(outside)
    refused(["sweep", str(grid), "--store", str(tmp_path / "store"), "--quiet", "--charts", str(charts)],
            capsys, names=f"{grid}: the name 'link/c.png' leads outside {charts}")
    assert list(outside.iterdir()) == []


def test_the_stores_chart_path_is_confined_to_its_charts_folder(tmp_path):
    store = Store(tmp_path / "store")
    for bad in ("../x.png", "a/../../x.png", "/x.png", ""):
        with pytest.raises(ValueError, match="chart path"):
            store.write_bytes(bad, b"png")
    assert store.write_bytes("g/c.png", b"png") == str(tmp_path / "store" / "_charts" / "g" / "c.png")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["_charts", "c.png", "g", "store"]


def test_name_problem_and_inside():
    from kvbench.outputs import inside, name_problem
    assert name_problem("speed-by-block-size.png") == "" and name_problem("a/b.png") == ""
    assert name_problem("..") and name_problem("a/../b") and name_problem("/etc/x") and name_problem(" ")
    assert inside("/srv/charts", "a/b.png") == Path("/srv/charts/a/b.png")
    with pytest.raises(ValueError, match=r"^g.toml:3: the name '\.\./x'"):
        inside("/srv/charts", "../x", "g.toml:3")


# --- charts and default outputs ----------------------------------------------------------------


def test_a_chart_drawn_twice_is_the_same_bytes_and_names_no_software_version(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvbench.charts import finish
    paths = []
    for name in ("a.png", "b.png"):
        fig, ax = plt.subplots()
        ax.plot([1, 2, 3], [3, 1, 2])
        paths.append(finish(fig, tmp_path / name, {"commit": "abc", "machine": {}, "created": "2026"}))
        plt.close(fig)
    a, b = (p.read_bytes() for p in paths)
    assert a == b
    assert b"Matplotlib" not in a and b"Software" not in a  # matplotlib's version would differ by install


def test_a_sweep_chart_drawn_twice_is_the_same_bytes():
    import pandas as pd

    from kvbench.bench import sweep_charts
    df = pd.DataFrame({"backend": ["a", "a"], "status": ["pass", "pass"], "budget": [1, 2], "m": [0.5, 0.25],
                       "parameters": ["backend,budget"] * 2})
    spec = {"kind": "lines", "x": "budget", "metric": "m"}
    first, second = sweep_charts.draw(df, spec), sweep_charts.draw(df, spec)
    assert first == second and b"Matplotlib" not in first[1]


def ignored_by_git(path: Path) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0


@pytest.mark.parametrize("argv, option", [
    (["eviction", "workloads/tenant-flood.jsonl"], "out"),
    (["fuzz", "--backend", "numpy"], "out"),
    (["sweep", "g.toml"], "store"),
])
def test_the_default_output_folders_are_ones_git_ignores(argv, option):
    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    from kvbench.cli import parser
    folder = Path(getattr(parser().parse_args(argv), option))
    assert ignored_by_git(folder / "x.png"), folder


def test_sweep_charts_go_into_the_store_by_default(tmp_path):
    grid = tmp_path / "g.toml"
    grid.write_text(GRID.format(name="g", chart="c"))
    assert main(["sweep", str(grid), "--store", str(tmp_path / "store"), "--quiet"]) == 0
    assert [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.png")] == ["store/_charts/g/c.png"]


# --- the docs match what runs ------------------------------------------------------------------


def mooncake(tmp_path) -> str:
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"timestamp": 10 * i, "input_length": 1024, "output_length": 4,
                                        "hash_ids": [0, i + 1]}) + "\n" for i in range(6)))
    return str(path)


def test_serve_with_offload_runs_as_the_readme_shows_it(tmp_path, capsys):
    # README: kvbench serve --trace T --format mooncake --offload host=8000,disk=40000
    code = main(["serve", "--trace", mooncake(tmp_path), "--format", "mooncake", "--offload",
                 "host=8000,disk=40000", "--quiet", "--output", str(tmp_path / "r.json")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "--offload: serving on numpy " in out.out
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [r["backend"] for r in rows] == ["numpy"]
    # 6 requests of 2 blocks of 512 = 64 blocks of 16 each; block 0 (32 of those) is shared: the
    # first computes all 64, each later one finds the 32 of block 0 (on the device or below)
    hits = {k: sum(r[k] for r in rows) for k in ("prefix_hit_blocks", "host_hit_blocks", "disk_hit_blocks")}
    assert sum(hits.values()) == 5 * 32  # 160 = (6 - 1) * 512 / 16
    assert rows[0]["computed_blocks"] == 6 * 64 - 5 * 32  # 224


HEAD = '{"kvbench_trace": 1, "family": "t"}\n'


@pytest.mark.parametrize("ops", [
    ['{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40}',
     '{"step": 1, "op": "preempt", "seq": 0}', '{"step": 2, "op": "free", "seq": 0}'],
    ['{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40}',
     '{"step": 1, "op": "append", "seqs": [0], "tokens": [4], "draft": [4]}', '{"step": 2, "op": "free", "seq": 0}'],
    ['{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40}', '{"step": 1, "op": "abort", "seq": 0}'],
], ids=["free-of-preempted", "free-of-drafting", "abort-with-nothing-in-flight"])
def test_what_the_docs_call_legal_loads(ops):
    assert len(loads(HEAD + "\n".join(ops) + "\n").ops) == len(ops)


@pytest.mark.parametrize("last, why", [
    ('{"step": 2, "op": "append", "seqs": [0], "tokens": [1]}', "append to preempted sequence 0"),
    ('{"step": 2, "op": "fork", "seq": 1, "src": 0}', "fork from preempted sequence 0"),
])
def test_what_the_docs_call_refused_is_refused_with_the_line(last, why):
    text = (HEAD + '{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40}\n'
            '{"step": 1, "op": "preempt", "seq": 0}\n' + last + "\n")
    with pytest.raises(TraceError, match=why) as e:
        loads(text, "t.jsonl")
    assert "t.jsonl:4" in str(e.value)


def test_csv_refuses_block_hashes_it_cannot_hold():
    trace = loads(HEAD + '{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 32, '
                         '"block_hashes": [1, 2]}\n')
    with pytest.raises(TraceError, match="CSV holds no block hashes"):
        to_csv(trace)
