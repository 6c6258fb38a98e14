"""The `kvbench` command end to end, in process."""
from pathlib import Path

from kvbench.cli import main

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def test_run_on_a_tenant_mix_prints_the_tenant_tables(tmp_path, capsys):
    out = tmp_path / "run.json"
    code = main(["run", "--quiet", str(WORKLOADS / "tenant-fractional.jsonl"), "--backend", "numpy",
                 "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "per tenant" in text and "the oracle's replay under each policy" in text
    assert "KV formats for a" in text  # the capacity table
    assert "3 runs: 3 pass, 0 fail, 0 error, 0 n/a" in text  # lru, lfu, fair
    assert out.exists()


def test_check_refuses_a_bad_trace_naming_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kvbench_trace": 1, "family": "t"}\n'
                   '{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 4}\n'
                   '{"step": 1, "op": "append", "seqs": [7], "tokens": [1]}\n')
    assert main(["check", str(bad), "--backend", "numpy"]) == 2
    assert f"{bad}:3: append to unknown sequence 7" in capsys.readouterr().err


def test_list_names_every_builtin(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    for name in ("numpy", "numpy-int8", "torch", "contiguous-max", "vllm-blockpool", "python-objects"):
        assert name in text


def test_the_default_run_replays_a_variant_on_its_workloads_only(monkeypatch):
    import dataclasses

    from conftest import A, P, X, make_trace

    from kvbench.analyses import suite
    from kvbench.contract import registry
    numpy = dataclasses.replace(registry.resolve("numpy"), default_workloads=("a",))
    monkeypatch.setattr(registry, "entries", lambda: {"numpy": numpy})
    traces = [make_trace(P(0, 20), A((0, 1),), X(0), name=n) for n in ("a", "b")]
    default = suite.run_suite(traces, ["numpy"], default_run=True)
    assert [r["workload"] for r in default] == ["a"]
    named = suite.run_suite(traces, ["numpy"])  # a run that names its backends runs them all
    assert [r["workload"] for r in named] == ["a", "b"]


def test_the_expectations_line_never_reports_negative_time_saved(capsys):
    import pandas as pd

    from kvbench.cli.run import print_expectations
    # Reading two files took 2.4 s more than computing them did: nothing was saved.
    df = pd.DataFrame({"expectations": ["reused", "reused"], "expectations_saved_s": [-1.5, -0.9]})
    print_expectations(df, Path("cache"))
    text = capsys.readouterr().out
    assert "2 of 2 checks reused" in text and "no time saved" in text and "-" not in text


def test_check_with_a_cache_it_cannot_write_says_the_cache_is_off(tmp_path, monkeypatch):
    import pytest

    from kvbench.checking.expectations import CacheWarning
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVBENCH_CACHE", str(blocker))
    with pytest.warns(CacheWarning) as caught:
        assert main(["check", str(WORKLOADS / "fork-beam.jsonl"), "--backend", "numpy"]) == 0
    assert len(caught) == 1
    assert "expectations cache off" in str(caught[0].message) and str(blocker) in str(caught[0].message)
