"""`kvbench compare`: records side by side, ratios to the first, PNG charts."""
import json

import pytest

from kvbench.bench import compare as C
from kvbench.bench import records
from kvbench.cli import main as kvbench


def run_row(backend, ops_per_s, tokens, device="cpu", series=True, workload="w", policy="-"):
    """A run row over a budget of 160 slots (10 blocks of 16)."""
    row = {"workload": workload, "backend": backend, "policy": policy, "device": device,
           "status": "pass", "peak_blocks": 3, "mean_fragmentation": 0.25,
           "mean_token_states": tokens, "mean_reservation": 8, "mean_internal_fragmentation": 8,
           "mean_external_fragmentation": 0, "mean_free": 160 - tokens - 16,
           "backend_ms": 1.0, "ops_per_s": ops_per_s}
    if series:
        row["series"] = {"blocks_used": [1, 2, 3, 0], "fragmentation": [0.5, 0.25, 0.125, 0.0]}
    return row


def write(tmp_path, name, rows, kind="run", device="cpu"):
    rec = records.record(kind, rows, {"made": "by hand"}, device=device)
    return records.write(rec, tmp_path / f"{name}.json")


@pytest.fixture
def two(tmp_path):
    a = write(tmp_path, "cpu", [run_row("numpy", 1000.0, 40), run_row("contiguous-oracle", 4000.0, 40)])
    b = write(tmp_path, "gpu", [run_row("numpy", 2000.0, 40, device="cuda"),
                                run_row("contiguous-oracle", 4000.0, 40, device="cuda")], device="cuda")
    return a, b


def test_ratios_to_the_first_record(two, tmp_path):
    legend, table, made = C.compare(two, out=tmp_path / "charts")
    # Rows line up across devices: the device is not part of what identifies a row.
    assert table.loc[("w", "numpy", "-"), ("ops_per_s", "B/A")] == 2.0  # 2000 / 1000
    assert table.loc[("w", "contiguous-oracle", "-"), ("ops_per_s", "B/A")] == 1.0  # 4000 / 4000
    assert table.loc[("w", "numpy", "-"), ("status", "A")] == "pass"
    assert legend[0].startswith(f"A = {two[0]}: run, commit ")
    assert legend[1].startswith(f"B = {two[1]}: run") and "(cuda, " in legend[1]


def test_charts_are_png_files(two, tmp_path):
    _, _, made = C.compare(two, out=tmp_path / "charts")
    names = sorted(p.name for p in made)
    assert names == ["blocks_over_replay.png", "fragmentation_over_replay.png",
                     "memory_breakdown.png", "throughput.png"]
    for p in made:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_no_chart_without_its_figures(tmp_path):
    rows = [{"workload": "w", "backend": "numpy", "policy": "-", "peak_blocks": 3}]
    a, b = write(tmp_path, "a", rows), write(tmp_path, "b", rows)
    _, table, made = C.compare([a, b], out=tmp_path / "charts")
    assert made == []
    assert table.loc[("w", "numpy", "-"), ("peak_blocks", "B/A")] == 1.0


def test_zero_baseline_gives_no_ratio(tmp_path):
    a = write(tmp_path, "a", [{"workload": "w", "backend": "x", "evictions": 0}])
    b = write(tmp_path, "b", [{"workload": "w", "backend": "x", "evictions": 5}])
    _, table, _ = C.compare([a, b], metrics=["evictions"])
    assert table[("evictions", "B/A")].isna().all()


def test_three_records(tmp_path):
    paths = [write(tmp_path, n, [run_row("numpy", v, 40, series=False)])
             for n, v in (("a", 100.0), ("b", 300.0), ("c", 50.0))]
    _, table, _ = C.compare(paths, metrics=["ops_per_s"])
    row = table.loc[("w", "numpy", "-")]
    assert (row[("ops_per_s", "B/A")], row[("ops_per_s", "C/A")]) == (3.0, 0.5)  # 300/100, 50/100


def test_gpu_check_rows_split_by_bench(tmp_path):
    rows = [{"bench": "decode", "impl": "numpy", "batch": 1, "median_s": 2e-4, "tokens_per_s": 5000.0},
            {"bench": "decode", "impl": "numpy", "batch": 16, "median_s": 4e-4, "tokens_per_s": 40000.0},
            {"bench": "bandwidth", "impl": "numpy", "what": "gather", "median_s": 1e-5,
             "fraction_of_copy": 0.5}]
    faster = [dict(r, median_s=r["median_s"] / 4) for r in rows]
    a = write(tmp_path, "a", rows, kind="gpu_check")
    b = write(tmp_path, "b", faster, kind="gpu_check", device="cuda")
    _, table, made = C.compare([a, b], out=tmp_path / "charts")
    parts = dict(C.sections(table))
    assert set(parts) == {"bench = decode", "bench = bandwidth"}
    decode = parts["bench = decode"]
    assert ("fraction_of_copy", "A") not in decode.columns  # empty in this part
    assert decode[("median_s", "B/A")].tolist() == [0.25, 0.25]  # (2e-4 / 4) / 2e-4
    assert [p.name for p in made] == ["throughput.png"]


def test_bad_input(tmp_path, two):
    with pytest.raises(ValueError, match="two or more"):
        C.compare([two[0]])
    dup = write(tmp_path, "dup", [run_row("numpy", 1.0, 40), run_row("numpy", 2.0, 40)])
    with pytest.raises(ValueError, match="record B: several rows share"):
        C.compare([two[0], dup])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="not a kvbench result record"):
        C.compare([two[0], other])


def test_command(two, tmp_path, capsys):
    assert kvbench(["compare", str(two[0]), str(two[1]), "--out", str(tmp_path / "c"), "--csv",
                    str(tmp_path / "t.csv")]) == 0
    out = capsys.readouterr().out
    assert "B/A" in out and "chart: " in out and (tmp_path / "t.csv").exists()
    assert kvbench(["compare", str(two[0])]) == 2


def test_records_that_measured_different_things_are_refused_unless_forced(tmp_path, capsys):
    rows = [run_row("numpy", 1000.0, 40)]
    a = records.write(records.record("run", rows, {"model": "tiny", "block_size": 16}),
                      tmp_path / "a.json")
    b = records.write(records.record("run", rows, {"model": "llama-3-8b", "block_size": 16}),
                      tmp_path / "b.json")
    c = records.write(records.record("run", rows + [run_row("numpy", 1.0, 40, workload="v")],
                                     {"model": "tiny", "block_size": 16}), tmp_path / "c.json")
    with pytest.raises(ValueError, match=r"model: A tiny, B llama-3-8b\): --force"):
        C.compare([a, b])
    with pytest.raises(ValueError, match="workloads: A w, B v w"):
        C.compare([a, c])
    assert kvbench(["compare", str(a), str(b), "--no-charts"]) == 2
    assert "did not measure the same thing" in capsys.readouterr().err
    legend, table, _ = C.compare([a, b], force=True)
    assert "WARNING: not comparable: model: A tiny, B llama-3-8b" in legend
    assert table.loc[("w", "numpy", "-"), ("ops_per_s", "B/A")] == 1.0  # compared all the same
