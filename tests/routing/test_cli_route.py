"""`kvbench route`: figures and a record under --out, a grid's charts, a planted fault's exit 1, and
bad input refused with its file and line (exit 2)."""
from __future__ import annotations

import json

import pytest
from test_route import TINY

from kvbench.cli import main


def test_route_writes_its_record_and_the_figures(tmp_path, capsys):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(TINY)
    out = tmp_path / "out"
    assert main(["route", str(trace), "--replicas", "2", "--router", "round-robin", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "available 12 " in text and "captured 4 " in text  # test_route's hand figures
    record = json.loads((out / "tiny-route.json").read_text())
    assert record["totals"]["routing_gap"] == 8  # 12 - 4
    assert [r["replica"] for r in record["requests"]] == [0, 1, 0, 1]


def test_a_grid_over_n_and_cache_size_draws_both_charts(tmp_path, capsys):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(TINY)
    out = tmp_path / "out"
    assert main(["route", str(trace), "--replicas", "1,2", "--blocks", "16,64", "--out", str(out)]) == 0
    rows = json.loads((out / "tiny-grid.json").read_text())
    assert [(r["num_blocks"], r["replicas"]) for r in rows] == [(16, 1), (16, 2), (64, 1), (64, 2)]
    assert (out / "tiny-vs-replicas.png").stat().st_size > 0
    assert (out / "tiny-vs-cache.png").stat().st_size > 0


def test_a_planted_fault_exits_1_and_says_which(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["route", "workloads/prefix-reuse.jsonl", "--plant", "own-block-size", "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 1
    assert "FAIL keys" in text and "the router's keys are at fault, not its index" in text


@pytest.mark.parametrize("line, names", [
    ('{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1]}', ":2:"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 2}', ":2:"),
])
def test_bad_input_names_its_file_and_line(tmp_path, capsys, line, names):
    good = '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}'
    path = tmp_path / "m.jsonl"
    path.write_text(good + "\n" + line + "\n")
    code = main(["route", str(path), "--format", "mooncake", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and f"m.jsonl{names}" in err, err


def test_a_request_no_replica_can_hold_is_refused(tmp_path, capsys):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(TINY)
    code = main(["route", str(trace), "--blocks", "2", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "tiny.jsonl: step 2: a request of 12 + 0 tokens does not fit" in err, err


def test_a_bad_reset_is_refused(tmp_path, capsys):
    trace = tmp_path / "tiny.jsonl"
    trace.write_text(TINY)
    code = main(["route", str(trace), "--reset", "9@1", "--out", str(tmp_path / "out")])
    assert code == 2 and "replica 9" in capsys.readouterr().err


@pytest.mark.parametrize("weight", ["-1", "nan", "x"])
def test_a_bad_overlap_weight_is_refused(tmp_path, capsys, weight):
    code = main(["route", "workloads/prefix-reuse.jsonl", "--overlap-weight", weight,
                 "--out", str(tmp_path / "out")])
    assert code == 2 and "--overlap-weight" in capsys.readouterr().err
