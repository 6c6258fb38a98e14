"""`kvbench sweep` on the local executor: the grid and its cells, one record per cell in the Parquet
store, resume after an interrupt, errors recorded, progress, charts, `kvbench results`/`compare`."""
from __future__ import annotations

import dataclasses
import io
import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from conftest import A, P, X, default_sigint, make_trace
from kvbench.bench import grid as grids
from kvbench.bench import sweep, sweep_charts
from kvbench.bench.store import CorruptCell, Store
from kvbench.analyses import suite
from kvbench.analyses.settings import RunSettings
from kvbench.cli import main
from kvbench.traces.format import save

ROOT = Path(__file__).resolve().parents[2]


def write_grid(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def hand_trace(tmp_path) -> Path:
    # 40 tokens, then 9 more: 49 tokens of one sequence.
    path = tmp_path / "hand.jsonl"
    save(make_trace(P(0, 40), A((0, 9)), X(0), name="hand"), str(path))
    return path


GRID = """
name = "g"
backends = ["numpy", "contiguous-pow2"]
seeds = [0, 1]
[[traces]]
path = "hand.jsonl"
[[traces]]
family = "fork_trees"
params = { mode = "beam", num_trees = 1, law = { name = "uniform", prompt = [17, 40], output = [4, 12] }, max_prompt = 40, max_output = 12 }
vary = { width = [2, 3] }
[settings]
block_size = [8, 16]
budget = ["64", "128"]
store_kv = false
gather = "none"
[[exclude]]
backend = "contiguous-pow2"
block_size = 8
"""


def test_grid_expands_to_the_product_less_the_excluded(tmp_path):
    hand_trace(tmp_path)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", GRID))
    cells, traces = grids.expand(g, "code")
    # hand.jsonl (a file: seeds do not apply): 2 block sizes x 2 budgets x 2 backends = 8;
    # fork_trees: 2 seeds x 2 widths x 2 x 2 x 2 = 32; excluded: contiguous-pow2 at B=8:
    # 2 budgets (hand) + 2 seeds x 2 widths x 2 budgets (fork) = 10.  30 = 8 + 32 - 10
    assert len(cells) == 30
    assert len({c.id for c in cells}) == 30
    assert not [c for c in cells if c.backend == "contiguous-pow2" and c.settings["block_size"] == 8]
    # 1 hand trace + 2 seeds x 2 widths of fork_trees, each shipped once
    assert len(traces) == 5
    assert {c.seed for c in cells if c.trace == "hand"} == {None}
    fork = next(c for c in cells if c.trace == "fork_trees")
    assert traces[fork.trace_key].header.params["width"] == fork.params["width"]


def test_include_adds_cells_and_ids_follow_what_the_cell_runs(tmp_path):
    hand_trace(tmp_path)
    text = GRID + '[[include]]\nbackend = "python-objects"\nblock_size = 16\ntrace = "hand"\n'
    cells, _ = grids.expand(grids.load_grid(write_grid(tmp_path / "g.toml", text)), "code")
    added = [c for c in cells if c.backend == "python-objects"]
    # hand only, B=16 only, both budgets: 2 cells
    assert len(cells) == 32 and len(added) == 2
    assert {c.settings["budget"] for c in added} == {"64", "128"}
    # The id changes with the code and with any setting, not with the order of expansion.
    again, _ = grids.expand(grids.load_grid(tmp_path / "g.toml"), "code")
    other, _ = grids.expand(grids.load_grid(tmp_path / "g.toml"), "other-code")
    assert [c.id for c in again] == [c.id for c in cells]
    assert not {c.id for c in other} & {c.id for c in cells}


@pytest.mark.parametrize("text, message", [
    ('backends = ["numpy"]\n[[traces]]\nworkload = "fork-beam"\n[settings]\nblock_sise = 8\n',
     "unknown setting(s) ['block_sise']"),
    ('backends = ["numpy"]\nbackend = "x"\n[[traces]]\nworkload = "fork-beam"\n', "unknown key(s) ['backend']"),
    ('backends = ["numpy"]\n[[traces]]\nworkload = "no-such-*"\n', "no committed workload matches 'no-such-*'"),
    ('backends = ["numpy"]\n[[traces]]\nworkload = "fork-beam"\npath = "x.jsonl"\n', "name exactly one of"),
    ('backends = ["numpy"]\n[[traces]]\nfamily = "fork_tree"\n', "unknown family 'fork_tree'"),
    ('backends = ["numpy"]\n[[traces]]\nworkload = "fork-beam"\n[[exclude]]\nbudgit = 3\n', "exclude[0]: unknown key(s) ['budgit']"),
    ('backends = ["numpy"]\n[[traces]]\nworkload = "fork-beam"\n[[include]]\ntrace = "nothing"\n', "include[0]"),
    ('backends = ["numpy"\n', "g.toml"),
])
def test_bad_grids_are_refused_naming_what_is_wrong(tmp_path, text, message):
    with pytest.raises(ValueError) as e:
        grids.expand(grids.load_grid(write_grid(tmp_path / "g.toml", text)), "code")
    assert message in str(e.value) and "g.toml" in str(e.value)


def test_a_setting_run_settings_gains_later_is_a_grid_setting(tmp_path, monkeypatch):
    # A later field of RunSettings (say KV cache groups or salts) needs no change to the sweep:
    # the grid knows it and types its values with the field's own check.
    seen = []

    @dataclasses.dataclass(frozen=True)
    class WithSalts(RunSettings):
        salts: int | None = dataclasses.field(default=None, metadata={
            "check": lambda v: "" if isinstance(v, int) else "must be a count"})

        def config(self, trace, policy=None):
            seen.append(self.salts)
            return super().config(trace, policy)
    monkeypatch.setattr(grids, "RunSettings", WithSalts)
    monkeypatch.setattr(suite, "RunSettings", WithSalts)
    assert grids.known_settings()["salts"] == "config"
    with pytest.raises(ValueError, match=r"settings\.salts\[1\]: must be a count, got 'x'"):
        grids.load_grid(write_grid(tmp_path / "bad.toml", 'backends = ["numpy"]\n[[traces]]\n'
                                   'workload = "fork-beam"\n[settings]\nsalts = [1, "x"]\n'))
    hand_trace(tmp_path)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", 'backends = ["numpy"]\n[[traces]]\npath = "hand.jsonl"\n'
                                   '[settings]\nsalts = [1, 3]\n'))
    cells, traces = grids.expand(g, "code")
    store = Store(tmp_path / "store")
    rows = [sweep.run_cell(c, traces[c.trace_key], store, {"commit": "c", "dirty": False}) for c in cells]
    assert sorted(seen) == [1, 3] and all(r["status"] == "pass" for r in rows)
    assert sorted(store.read("g")["salts"]) == [1, 3]


def test_policy_auto_expands_per_trace_like_kvbench_run(tmp_path):
    g = grids.load_grid(write_grid(tmp_path / "g.toml", 'backends = ["numpy"]\n[[traces]]\nworkload = "tenant-fractional"\n'
                                   '[[traces]]\nworkload = "fork-beam"\n[settings]\npolicy = "auto"\n'))
    cells, _ = grids.expand(g, "code")
    # a tenant mix: lru, lfu, fair; fork-beam: none
    assert sorted((c.trace, c.settings["policy"]) for c in cells) == [
        ("fork-beam", "none"), ("tenant-fractional", "fair"), ("tenant-fractional", "lfu"),
        ("tenant-fractional", "lru")]


def test_cuda_cells_ask_for_a_gpu(tmp_path):
    g = grids.load_grid(write_grid(tmp_path / "g.toml", 'backends = ["torch", "numpy"]\n[[traces]]\nworkload = "fork-beam"\n'
                                   '[settings]\ndevice = ["cpu", "cuda"]\n[resources]\nnum_cpus = 2\n'))
    res = {(c.backend, c.settings["device"]): c.resources for c in grids.expand(g, "code")[0]}
    assert res[("torch", "cuda")] == {"num_cpus": 2, "num_gpus": 1}
    assert res[("torch", "cpu")] == {"num_cpus": 2}


# --- cells and the store --------------------------------------------------------------------------


def test_a_cell_records_the_verdict_figures_parameters_and_machine(tmp_path):
    hand_trace(tmp_path)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", 'backends = ["numpy", "my_pkg.nowhere:Pool"]\n'
                                   '[[traces]]\npath = "hand.jsonl"\n[settings]\nblock_size = 16\nbudget = "8"\n'))
    cells, traces = grids.expand(g, "code-1")
    store = Store(tmp_path / "store")
    for c in cells:
        sweep.run_cell(c, traces[c.trace_key], store, {"commit": "abc", "dirty": False})
    df = store.read("g").set_index("backend")
    ok = df.loc["numpy"]
    assert ok["status"] == "pass" and ok["error"] == ""
    assert ok["peak_blocks"] == 4  # 4 = ceil(49 / 16)
    assert ok["num_blocks"] == 8 and ok["block_size"] == 16 and ok["budget"] == "8"
    assert ok["trace"] == "hand" and ok["code"] == "code-1" and ok["commit"] == "abc"
    assert ok["machine_cpus"] > 0 and ok["wall_s"] > 0
    assert set(ok["parameters"].split(",")) == {"trace", "seed", "backend", "block_size", "budget"}
    # An unimportable backend is an error of its cell, recorded with the reason; the sweep goes on.
    bad = df.loc["my_pkg.nowhere:Pool"]
    assert bad["status"] in ("ERROR", "n/a")
    assert "my_pkg" in (bad["error"] + str(bad.get("not_applicable", "")))


def test_an_exception_in_a_cell_is_recorded_as_error(tmp_path, monkeypatch):
    hand_trace(tmp_path)
    # A budget that is not a size raises in its cell: the grid check that refuses it is let go.
    monkeypatch.setattr(sweep, "check_cells", lambda grid, cells, traces: None)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", 'backends = ["numpy"]\n[[traces]]\npath = "hand.jsonl"\n'
                                   '[settings]\nbudget = ["lots", "8"]\n'))
    store = Store(tmp_path / "store")
    run = sweep.run_sweep(g, store, workers=1, progress={"enabled": False})
    assert run.summary == {"ERROR": 1, "pass": 1}
    df = store.read("g").set_index("budget")
    assert df.loc["lots", "status"] == "ERROR" and "'lots'" in df.loc["lots", "error"]
    assert df.loc["8", "status"] == "pass"
    # A finished cell is never run twice; --retry-errors runs the errored one again.
    assert sum(sweep.run_sweep(g, store, workers=1, progress={"enabled": False}).summary.values()) == 0
    assert sweep.run_sweep(g, store, workers=1, retry_errors=True, progress={"enabled": False}).summary == {"ERROR": 1}


def test_store_partitions_hides_partial_files_and_unifies_schemas(tmp_path):
    store = Store(tmp_path / "s")
    store.write_cell("a b", "pkg.mod:Pool", "c1", {"x": 1, "seed": None, "status": "pass"})
    store.write_cell("a b", "numpy", "c2", {"x": 2, "seed": 7, "extra": "e", "status": "FAIL"})
    (tmp_path / "s" / "sweep=a%20b" / "backend=numpy" / ".c3.tmp").write_bytes(b"half a file")
    assert store.sweeps() == ["a b"]
    assert store.done("a b") == {"c1", "c2"}
    df = store.read("a b").set_index("x")
    assert df.loc[1, "backend"] == "pkg.mod:Pool" and df.loc[2, "backend"] == "numpy"
    assert df.loc[1, "sweep"] == "a b"
    assert str(df["seed"].dtype) == "Int64" and df.loc[2, "seed"] == 7 and pd.isna(df.loc[1, "seed"])
    assert pd.isna(df.loc[1, "extra"]) and df.loc[2, "extra"] == "e"
    assert (tmp_path / "s" / "sweep=a%20b" / "backend=pkg.mod%3APool" / "c1.parquet").is_file()


def test_store_at_an_fsspec_url(tmp_path):
    store = Store("memory://kvbench-test/store")
    store.write_cell("s", "numpy", "c1", {"x": 1, "status": "pass"})
    assert store.done("s") == {"c1"} and store.read("s")["x"].tolist() == [1]
    assert store.write_bytes("s/chart.png", b"png") == "memory://kvbench-test/store/_charts/s/chart.png"


# --- a sweep on the local pool -------------------------------------------------------------------


def test_a_sweep_runs_every_cell_once_and_resumes_what_is_missing(tmp_path):
    hand_trace(tmp_path)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", GRID))
    store = Store(tmp_path / "store")
    first = sweep.run_sweep(g, store, workers=2, progress={"enabled": False})
    assert first.summary == {"pass": 30} and first.skipped == 0 and not first.lost
    df = store.read("g")
    assert len(df) == 30 and set(df["cell_id"]) == {c.id for c in first.cells}
    # Lose three cells: only those run again.
    for path in sorted((tmp_path / "store").rglob("*.parquet"))[:3]:
        path.unlink()
    again = sweep.run_sweep(g, store, workers=2, progress={"enabled": False})
    assert again.summary == {"pass": 3} and again.skipped == 27
    assert store.info("g")["cells"] == 30


def test_plain_tools_read_the_store_with_one_typed_schema(tmp_path):
    """pandas.read_parquet and DuckDB read the store as it is: one type per column, whatever a
    cell's values (a trace file's cells have no seed; budgets given as blocks and as bytes)."""
    import duckdb

    hand_trace(tmp_path)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", GRID.replace('budget = ["64", "128"]',
                                                                     'budget = [64, "16KiB"]')))
    sweep.run_sweep(g, Store(tmp_path / "store"), workers=2, progress={"enabled": False})
    df = pd.read_parquet(tmp_path / "store")
    assert len(df) == 30
    assert df["seed"].isna().sum() == 6  # the file trace: 2 backends' 3 settings (x 2 budgets)
    assert pd.api.types.is_datetime64_any_dtype(df["started"])
    blocks = df.set_index(["budget", "block_size"])["budget_blocks"]
    # The tiny model: 128 bytes per token (2 * 2 layers * 2 heads * 8 * 2 bytes).
    assert set(blocks.loc[("64", 8)]) == {64} and set(blocks.loc[("16KiB", 16)]) == {8}  # 8 = 16384 / (16 * 128)
    assert (df["budget_bytes"] == df["budget_blocks"] * df["block_size"] * 128).all()
    rows = duckdb.sql(f"select count(*), count(seed), min(budget_bytes) from read_parquet("
                      f"'{tmp_path / 'store'}/**/*.parquet', hive_partitioning = true)").fetchall()
    assert rows == [(30, 24, 16 * 1024)]  # the smallest pool: 16 KiB (64 blocks of 8 tokens is 64 KiB)


def test_a_corrupt_cell_is_named_skipped_and_run_again(tmp_path):
    hand_trace(tmp_path)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", GRID))
    store = Store(tmp_path / "store")
    sweep.run_sweep(g, store, workers=2, progress={"enabled": False})
    truncated, garbage = sorted((tmp_path / "store").rglob("*.parquet"))[:2]
    truncated.write_bytes(truncated.read_bytes()[:100])
    garbage.write_bytes(b"not parquet")
    with pytest.warns(CorruptCell) as caught:
        assert len(store.read("g")) == 28
    assert {str(truncated), str(garbage)} <= {str(w.message).split(": ")[0] for w in caught}
    with pytest.warns(CorruptCell):
        again = sweep.run_sweep(g, store, workers=2, progress={"enabled": False})
    assert again.summary == {"pass": 2} and again.skipped == 28
    assert len(store.read("g")) == 30  # no warning now: both were written over


def test_pinned_workers_each_take_one_core(tmp_path):
    hand_trace(tmp_path)
    g = grids.load_grid(write_grid(tmp_path / "g.toml", 'backends = ["numpy"]\n[[traces]]\npath = "hand.jsonl"\n'
                                   '[settings]\nbudget = ["8", "9", "10", "11"]\n'))
    store = Store(tmp_path / "store")
    run = sweep.run_sweep(g, store, workers=2, pin=True, progress={"enabled": False})
    assert run.summary == {"pass": 4}
    cores = store.read("g").groupby("worker_pid")["worker_cores"].agg(set)
    # every worker ran on one core, and no two workers on the same one
    assert all(len(c) == 1 and "," not in next(iter(c)) for c in cores)
    assert len({next(iter(c)) for c in cores}) == len(cores)


def test_sigint_stops_the_sweep_and_the_same_command_resumes_it(tmp_path):
    text = ('name = "int"\nbackends = ["numpy", "python-objects"]\nseeds = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]\n'
            '[[traces]]\nfamily = "decode_streams"\n'
            'params = { num_requests = 24, law = "alpaca", max_prompt = 100, max_output = 60 }\n'
            '[settings]\nblock_size = [8, 16]\nbudget = "32KiB"\nstore_kv = false\ngather = "none"\n')
    grid = write_grid(tmp_path / "g.toml", text)
    store = tmp_path / "store"
    cmd = [sys.executable, "-m", "kvbench.cli", "sweep", str(grid), "--store", str(store),
           "--workers", "2", "--progress-interval", "0.5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            preexec_fn=default_sigint)
    deadline = time.monotonic() + 120
    while not list(store.rglob("*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out
    assert "interrupted: run the same command again to resume" in out
    stored = len(Store(store).done("int"))
    # 48 = 12 seeds x 2 block sizes x 2 backends
    assert 0 < stored < 48, out
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"48 cells: {stored} were in the store, ran {48 - stored} ({48 - stored} pass)" in again.stdout
    assert len(Store(store).done("int")) == 48


def test_two_sweeps_of_one_grid_into_one_store_run_each_cell_once(tmp_path):
    text = ('name = "two"\nbackends = ["numpy", "python-objects"]\nseeds = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]\n'
            '[[traces]]\nfamily = "decode_streams"\n'
            'params = { num_requests = 24, law = "alpaca", max_prompt = 100, max_output = 60 }\n'
            '[settings]\nblock_size = [8, 16]\nbudget = "32KiB"\nstore_kv = false\ngather = "none"\n')
    cmd = [sys.executable, "-m", "kvbench.cli", "sweep", str(write_grid(tmp_path / "g.toml", text)),
           "--store", str(tmp_path / "store"), "--workers", "1", "--quiet"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    ran = [int(re.search(r"ran (\d+) ", out).group(1)) for out in outs]
    assert sum(ran) == 48, outs  # 48 = 12 seeds x 2 block sizes x 2 backends, each run by one sweep
    assert len(Store(tmp_path / "store").done("two")) == 48
    assert not list((tmp_path / "store").rglob(".*.claim"))


def test_a_claim_left_by_a_process_that_is_gone_is_taken_over(tmp_path):
    store = Store(tmp_path / "s")
    assert store.claim("s", "numpy", "c1") and not store.claim("s", "numpy", "c1")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    claim = next((tmp_path / "s").rglob(".c1.claim"))
    claim.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead)}))
    assert store.claim("s", "numpy", "c1")
    store.release("s", "numpy", "c1")
    assert not claim.exists()


def test_a_failed_task_whose_cell_was_stored_is_not_lost(tmp_path):
    store = Store(tmp_path / "s")
    cell = grids.Cell(sweep="s", trace="t", trace_key="t", backend="numpy", seed=None, params={},
                      settings={}, code="x", resources={}, id="c1")
    lost = []
    assert sweep._stored_or_lost(store, cell, "died", lost, wait=0.2) == "lost"
    assert lost == [(cell, "died")]
    store.write_cell("s", "numpy", "c1", {"status": "FAIL"})
    lost.clear()
    assert sweep._stored_or_lost(store, cell, "died", lost, wait=0.2) == "FAIL" and not lost


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    children: dict = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_no_child_outlives_a_sweep_driver_killed_with_sigkill(tmp_path):
    text = ('name = "k"\nbackends = ["numpy", "python-objects"]\nseeds = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]\n'
            '[[traces]]\nfamily = "decode_streams"\n'
            'params = { num_requests = 24, law = "alpaca", max_prompt = 100, max_output = 60 }\n'
            '[settings]\nblock_size = [8, 16]\nbudget = "32KiB"\nstore_kv = false\ngather = "none"\n')
    store = tmp_path / "store"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "sweep", str(write_grid(tmp_path / "g.toml", text)),
                             "--store", str(store), "--workers", "2"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not list(store.rglob("*.parquet")) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    family = _descendants(proc.pid)
    proc.kill()
    proc.wait()
    assert len(family) >= 3, family  # the forkserver and its two workers at least
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in family if _alive(p)]
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", CorruptCell)  # every file a resume counts done is whole
        stored = len(Store(store).done("k"))
    assert 0 < stored < 48  # 48 = 12 seeds x 2 block sizes x 2 backends: a resume has cells to run


# --- progress ------------------------------------------------------------------------------------


def test_progress_in_a_log_is_plain_lines():
    out = io.StringIO()
    p = sweep.CellProgress("s", total=10, done=4, stream=out, interval=0.0, tty=False)
    for status in ("pass", "FAIL", "ERROR"):
        p.update(status)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[-1].startswith("s: 7/10 cells (")  # 7 = 4 done + 3
    assert lines[-1].endswith(", 1 FAIL, 1 ERROR)") and "70%" in lines[-1] and "ETA" in lines[-1]
    assert len(lines) == 4  # a line per update (interval 0), one at close


def test_progress_on_a_terminal_is_a_tqdm_bar():
    out = io.StringIO()
    p = sweep.CellProgress("s", total=10, done=0, stream=out, tty=True)
    p.update("pass")
    p.close()
    assert p.bar is not None and p.bar.n == 1 and "\r" in out.getvalue()


# --- charts, results, compare --------------------------------------------------------------------


def test_heatmap_cells_are_the_mean_over_the_other_axes():
    df = pd.DataFrame({"backend": ["a"] * 6, "status": ["pass"] * 5 + ["FAIL"],
                       "block_size": [8, 8, 16, 16, 8, 16], "budget": ["2KiB", "2KiB", "2KiB", "1KiB", "1KiB", "1KiB"],
                       "seed": [0, 1, 0, 0, 0, 1], "frag": [0.1, 0.3, 0.5, 0.7, 0.9, 100.0],
                       "parameters": ["backend,block_size,budget,seed"] * 6})
    fig = sweep_charts.heatmap(df, "block_size", "budget", "frag")
    grid = fig.axes[0].images[0].get_array()
    # rows: budgets by size (1KiB, then 2KiB), columns B=8, B=16.
    # 1KiB: B=8 -> 0.9, B=16 -> 0.7 (the FAIL cell is left out); 2KiB: B=8 -> (0.1 + 0.3) / 2, B=16 -> 0.5
    np.testing.assert_allclose(grid, [[0.9, 0.7], [0.2, 0.5]])
    assert "mean over seed" in fig._suptitle.get_text()


def test_sweep_command_results_and_compare(tmp_path, capsys, monkeypatch):
    hand_trace(tmp_path)
    grid = write_grid(tmp_path / "g.toml", GRID + '[[charts]]\nkind = "heatmap"\nx = "block_size"\ny = "budget"\n'
                      'metric = "mean_fragmentation"\n[[charts]]\nkind = "lines"\nx = "budget"\nmetric = "peak_blocks"\n')
    store = str(tmp_path / "store")
    assert main(["sweep", str(grid), "--store", store, "--dry-run"]) == 0
    assert "g: 30 cells, 0 already in" in capsys.readouterr().out
    assert main(["sweep", str(grid), "--store", store, "--workers", "2", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "g: 30 cells: 0 were in the store, ran 30 (30 pass)" in out
    pngs = sorted(p.name for p in (tmp_path / "store" / "_charts" / "g").glob("*.png"))  # in the store
    assert pngs == ["heatmap-mean_fragmentation-budget-by-block_size.png", "lines-peak_blocks-by-budget.png"]
    assert main(["results", "--store", store]) == 0
    assert "g " in capsys.readouterr().out
    assert main(["results", "g", "--store", store, "--rows", "trace,block_size", "--cols", "budget",
                 "--metric", "peak_blocks", "--agg", "max", "--where", "backend=numpy"]) == 0
    table = capsys.readouterr().out
    # hand at B=16: 4 blocks whatever the budget (4 = ceil(49 / 16)); at B=8: 7 = ceil(49 / 8)
    line16 = next(line for line in table.splitlines() if line.split()[:2] == ["hand", "16"])
    assert line16.split()[2:] == ["4", "4"]
    line8 = next(line for line in table.splitlines() if line.split()[:2] == ["hand", "8"])
    assert line8.split()[2:] == ["7", "7"]
    cells = tmp_path / "cells.csv"
    assert main(["results", "g", "--store", store, "--csv", str(cells)]) == 0
    assert len(pd.read_csv(cells)) == 30  # one row per cell of the grid
    capsys.readouterr()
    # The CSV is written whole or not at all: a write that fails leaves the previous file.
    monkeypatch.setattr("os.replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    assert main(["results", "g", "--store", store, "--csv", str(cells), "--where", "block_size=8"]) == 2
    monkeypatch.undo()
    assert "cells.csv: No space left" in capsys.readouterr().err
    assert len(pd.read_csv(cells)) == 30
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".cells.")]  # no temporary left
    record = tmp_path / "run.json"
    record.write_text(json.dumps({"kind": "run", "machine": {}, "commit": "x", "created": "now",
                                  "rows": [{"workload": "hand", "backend": "numpy", "policy": "-", "peak_blocks": 4}]}))
    assert main(["compare", "sweep:g", "sweep:g", "--store", store, "--no-charts", "--metric", "peak_blocks"]) == 0
    assert "sweep:g: sweep, commit" in capsys.readouterr().out
    assert main(["compare", "sweep:g@zzz", str(record), "--store", store, "--no-charts"]) == 2
    assert "g: no cells of commit 'zzz'" in capsys.readouterr().err


def test_a_real_trace_through_its_loader_replays_as_a_prefix_cache(tmp_path):
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]},
            {"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [9]},
            {"timestamp": 2, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = grids.load_grid(write_grid(tmp_path / "g.toml", 'backends = ["numpy"]\n[[traces]]\nloader = "mooncake"\n'
                                   'path = "m.jsonl"\n[settings]\nblock_size = 512\nbudget = ["2", "3"]\n'
                                   'store_kv = false\ngather = "none"\n'))
    store = Store(tmp_path / "store")
    sweep.run_sweep(g, store, workers=1, progress={"enabled": False})
    df = store.read("g").set_index("budget")
    # 2 blocks: request 2 evicts request 1's tail (block 2, freed tail first), request 3 finds
    # block 1 only; 3 blocks: request 3 finds both. Of 5 = 2 + 1 + 2 hashed blocks.
    assert df.loc["2", "prefix_hit_blocks"] == 1 and df.loc["3", "prefix_hit_blocks"] == 2
    assert df.loc["2", "prefix_hit_rate"] == pytest.approx(1 / 5)
    assert df.loc["3", "prefix_hit_rate"] == pytest.approx(2 / 5)


def test_the_committed_sweeps_are_documented_with_the_cells_their_grids_expand_to():
    """results/sweeps/README.md and docs/sweeps.md name each committed grid's cell count: they must be
    what the grid expands to now (a workload added under a glob changes it)."""
    sweeps = ROOT / "results" / "sweeps"
    documented = dict(re.findall(r"^## ([\w-]+): (\d+) cells$", (sweeps / "README.md").read_text(), re.M))
    readme = (ROOT / "docs" / "sweeps.md").read_text()
    grids_here = sorted(p.parent.name for p in sweeps.glob("*/grid.toml"))
    assert sorted(documented) == grids_here
    for name in grids_here:
        cells, _ = grids.expand(grids.load_grid(sweeps / name / "grid.toml"), "x")
        assert int(documented[name]) == len(cells), name
        assert f"`{name}/` ({len(cells)}" in " ".join(readme.split()), name


def test_op_timeout_is_a_run_setting_of_a_grid_typed_before_the_first_cell(tmp_path):
    assert grids.known_settings()["op_timeout"] == "run"  # as `kvbench run --op-timeout`
    with pytest.raises(ValueError, match=r"settings\.op_timeout\[1\]: must be a number of seconds >= 0 "
                                         r"\(0: no limit\), got -1"):
        grids.load_grid(write_grid(tmp_path / "bad.toml", 'backends = ["numpy"]\n[[traces]]\n'
                                   'workload = "fork-beam"\n[settings]\nop_timeout = [60, -1]\n'))
