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


def _commands():
    import argparse

    from kvbench.cli import parser
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return p, sub.choices


def test_the_top_level_help_is_one_sentence_naming_every_command():
    p, commands = _commands()
    text = p.format_help()
    description = " ".join(p.description.split())
    assert description.endswith(".") and description.count(". ") == 0
    assert len(commands) >= 15  # run, check, serve, gen, prefix, compare, gates, list, ...
    for name in commands:
        assert f" {name}," in description or f" {name} " in description \
            or description.endswith(f" {name}."), name
    assert "examples:\n  kvbench run\n" in text


def test_every_command_help_ends_with_examples_that_parse():
    import shlex

    from kvbench.cli import parser
    _, commands = _commands()
    for name, command in commands.items():
        text = command.format_help()
        assert "\nexamples:\n" in text, name
        lines = text.split("\nexamples:\n", 1)[1].splitlines()
        runs = [line.split("#")[0].strip() for line in lines if line.strip()]
        assert runs and all(r.startswith(f"kvbench {name}") for r in runs), (name, runs)
        for r in runs:  # each example is a command line the parser takes
            args = parser().parse_args(shlex.split(r)[1:])
            assert args.command == name


def test_a_reader_that_leaves_keeps_the_exit_code():
    """`kvbench list | head -0`: stdout closed before the first line; the command still exits 0."""
    import os
    import subprocess
    import sys
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run([sys.executable, "-m", "kvbench.cli", "list"], stdout=write,
                              stderr=subprocess.PIPE, text=True, cwd=WORKLOADS.parent, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_a_terminated_sweep_says_terminated_and_exits_143_as_run_does(tmp_path, monkeypatch, capsys):
    from kvbench.bench import sweep
    from kvbench.cli import options

    def terminated(grid, store, **kw):
        return sweep.SweepRun(grid, [], 0, {}, [], options.Terminated(), 0.0)
    monkeypatch.setattr(sweep, "run_sweep", terminated)
    grid = WORKLOADS.parent / "results" / "sweeps" / "prefix-cache" / "grid.toml"
    code = main(["sweep", str(grid), "--store", str(tmp_path / "store"), "--quiet"])
    captured = capsys.readouterr()
    assert code == 143
    assert "terminated: run the same command again to resume" in captured.out
    assert captured.err == "kvbench: terminated\n"


def _two_prompts_sharing(path) -> None:
    """Two requests of 40 tokens whose 2 full blocks (B = 16) have the same hashes, one after
    the other: the second finds (40 - 1) // 16 = 2 blocks cached."""
    from kvbench.traces.format import Header, Trace, save
    from kvbench.traces.ops import Free, Prefill
    ops = [Prefill(0, 0, "a", 40, (1, 2)), Free(1, 0), Prefill(2, 1, "a", 40, (1, 2)), Free(3, 1)]
    save(Trace(Header(family="t", settings={"block_size": 16}), ops, name="shared"), str(path))


def test_check_prints_the_hit_blocks_backend_and_oracle(tmp_path, capsys):
    path = tmp_path / "shared.jsonl"
    _two_prompts_sharing(path)
    assert main(["check", str(path), "--backend", "numpy"]) == 0
    # 4 hashed = 2 prompts x 2 full blocks; 2 found on the device; 2 = 4 - 2 computed
    assert "hit blocks (of 4 hashed prompt blocks): device 2, computed 2" in capsys.readouterr().out


def test_a_backend_that_miscounts_its_hits_shows_beside_the_oracle(tmp_path):
    import dataclasses

    from conftest import make_config

    from impls.numpy_paged import NumpyPaged
    from kvbench.checking.checker import check
    from kvbench.cli.run import hit_line
    from kvbench.traces.format import load

    class OneHitMore(NumpyPaged):
        def ledger(self, seqs=None):
            led = super().ledger(seqs)
            return dataclasses.replace(led, prefix_hit_blocks=led.prefix_hit_blocks + 1)
    path = tmp_path / "shared.jsonl"
    _two_prompts_sharing(path)
    v = check(load(str(path)), OneHitMore(make_config(prefix_caching=True)), keep_going=True)
    assert v.status == "FAIL" and v.hit_blocks == {"device": (3, 2)}  # 3 = 2 + 1
    line = hit_line({"hit_blocks": v.hit_blocks, "hashed_blocks": 4})
    assert "device 3 (oracle 2)" in line


def test_check_takes_a_mooncake_trace(tmp_path, capsys):
    import json
    path = tmp_path / "mooncake.jsonl"
    # Two requests of 600 tokens with the same two 512-token hash ids: at B = 16 each has
    # 600 // 16 = 37 full blocks, and the second finds (600 - 1) // 16 = 37 of them cached.
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 600, "output_length": 3,
                                        "hash_ids": [7, 8]}) + "\n" for t in (0, 5)))
    assert main(["check", str(path), "--format", "mooncake", "--block-size", "16",
                 "--backend", "numpy"]) == 0
    out = capsys.readouterr().out
    assert "ops=6" in out  # prefill, append, free per request
    assert "hit blocks (of 74 hashed prompt blocks): device 37, computed 37" in out  # 74 = 2 * 37


def _mooncake_pair(path) -> None:
    import json
    path.write_text("".join(json.dumps({"timestamp": t, "input_length": 600, "output_length": 3,
                                        "hash_ids": [7, 8]}) + "\n" for t in (0, 5)))


def test_prefix_reports_a_backends_divergence_as_a_fail_naming_the_step(tmp_path, capsys):
    path = tmp_path / "mooncake.jsonl"
    _mooncake_pair(path)
    # A pool that counts a freed block on both sides (impls.faults.FifoReuse): wrong at the
    # first free, step 1. Caches of 40 and 80 blocks (a prompt needs ceil(600 / 16) = 38).
    args = ["prefix", str(path), "--block-size", "16", "--sizes", "40,80",
            "--backend", "impls.faults:FifoReuse"]
    assert main(args) == 1
    out, err = capsys.readouterr()
    fails = [line for line in out.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 1 and "cache of 40 blocks" in fails[0] and "step 1 " in fails[0]
    assert "internal error" not in err and "--keep-going checks every size" in out
    assert main(args + ["--keep-going"]) == 1
    fails = [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL ")]
    assert [("cache of 40 blocks" in f, "cache of 80 blocks" in f) for f in fails] == [
        (True, False), (False, True)]


def test_run_refuses_an_option_it_would_ignore(capsys):
    import pytest

    from kvbench.cli.options import UsageError
    trace = str(WORKLOADS / "fork-beam.jsonl")
    with pytest.raises(UsageError, match="--scenario runs the serving simulation and TRACE files"):
        _parse_and_run(["run", "--scenario", "opt13b", trace])
    with pytest.raises(UsageError, match="--speculative-k applies to the serving simulation"):
        _parse_and_run(["run", "--speculative-k", "4", trace])
    assert main(["run", "--max-batch", "8", trace]) == 2
    assert "--max-batch applies to the serving simulation" in capsys.readouterr().err


def _parse_and_run(argv):
    from kvbench.cli import _main
    return _main(argv)


def test_seeds_on_a_grid_of_committed_workloads_are_refused_at_their_line(tmp_path, capsys):
    grid = tmp_path / "g.toml"
    grid.write_text('name = "g"\nbackends = ["numpy"]\nseeds = [0, 1, 2]\n'
                    '[[traces]]\nworkload = "fork-beam"\n')
    assert main(["sweep", str(grid), "--dry-run", "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert f"{grid}:3: seeds = [0, 1, 2]: no trace of this grid takes a seed" in err


def test_compare_prints_its_table_then_says_it_draws_the_charts(tmp_path, monkeypatch, capsys):
    from kvbench.bench import compare, records
    rows = [{"workload": "w", "backend": "numpy", "policy": "-", "status": "pass",
             "ops_per_s": 1000.0, "series": {"blocks_used": [1, 2], "fragmentation": [0.5, 0.0]}}]
    paths = [records.write(records.record("run", rows, {}), tmp_path / f"{n}.json") for n in "ab"]
    seen = []

    def chart_series(*args, **kw):  # what the user had read when the charts began
        seen.append(capsys.readouterr())
        return None
    monkeypatch.setattr(compare, "chart_series", chart_series)
    assert main(["compare", *map(str, paths), "--out", str(tmp_path / "charts")]) == 0
    assert "ops_per_s" in seen[0].out  # the table came first
    assert f"compare: drawing up to 4 charts in {tmp_path / 'charts'}" in seen[0].err


def test_a_resumed_sweep_removes_the_temporary_files_a_killed_one_left(tmp_path):
    import json
    import os
    import socket

    from conftest import A, P, X, make_trace

    from kvbench.traces.format import save
    save(make_trace(P(0, 40), A((0, 9)), X(0), name="hand"), str(tmp_path / "hand.jsonl"))
    grid = tmp_path / "g.toml"
    grid.write_text('name = "g"\nbackends = ["numpy"]\n[[traces]]\npath = "hand.jsonl"\n'
                    '[settings]\nstore_kv = false\ngather = "none"\n')
    folder = tmp_path / "store" / "sweep=g" / "backend=numpy"
    folder.mkdir(parents=True)
    left = folder / ".deadcell.0123abcd.tmp"  # kill -9 between create and rename: zero bytes
    left.write_bytes(b"")
    writing = folder / ".livecell.4567cdef.tmp"  # another sweep's, its claim held by a live process
    writing.write_bytes(b"")
    (folder / ".livecell.claim").write_text(json.dumps({"host": socket.gethostname(),
                                                        "pid": os.getpid()}))
    assert main(["sweep", str(grid), "--store", str(tmp_path / "store"), "--workers", "1",
                 "--quiet", "--no-charts"]) == 0
    assert not left.exists() and writing.exists()
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp") and p != writing]


def test_every_command_that_reads_a_trace_takes_every_format_it_can():
    from kvbench.traces.loaders import LOADERS, trace_formats
    _, commands = _commands()
    takes = {}
    for name, command in commands.items():
        for a in command._actions:
            if a.dest in ("trace", "traces") and name != "faults":  # faults: the default suite's
                fmt = next((b for b in command._actions if "--format" in b.option_strings), None)
                takes[name] = fmt and list(fmt.choices)
    # prefix and serve need requests (lengths, arrivals, hashes): every public format
    requests = {"prefix", "serve"}
    assert set(takes) == {"check", "run", "shrink", "eviction", "prefix", "serve", "route"}
    for name, choices in takes.items():
        assert choices == (list(LOADERS) if name in requests else trace_formats()), name


def test_a_terminated_fuzz_says_terminated_and_exits_143(tmp_path, monkeypatch, capsys):
    from kvbench.search import fuzz
    from kvbench.cli import options

    def one(self, index, caps):  # SIGTERM in the first history
        raise options.Terminated
    monkeypatch.setattr(fuzz.Campaign, "one", one)
    code = main(["fuzz", "--backend", "numpy", "--max-histories", "3", "--quiet",
                 "--out", str(tmp_path / "out")])
    assert code == 143 and capsys.readouterr().err.endswith("kvbench: terminated\n")
    assert (tmp_path / "out" / "summary.md").exists()  # what it had, written


def test_a_fuzz_campaign_with_store_is_one_cell_of_sweep_fuzz(tmp_path, capsys):
    """--store records the campaign (3 histories, seed 5) as one cell; the same campaign of the
    same code run again is the same cell, not a second one."""
    from kvbench.bench.store import Store
    store = tmp_path / "store"
    for _ in range(2):
        code = main(["fuzz", "--backend", "numpy", "--max-histories", "3", "--seed", "5", "--quiet",
                     "--out", str(tmp_path / "out"), "--store", str(store)])
        assert code == 0, capsys.readouterr()
    df = Store(str(store)).read("fuzz")
    assert len(df) == 1
    row = df.iloc[0]
    assert (row["backend"], row["seed"], row["histories"], row["findings"], row["status"]) == \
        ("numpy", 5, 3, 0, "pass")
    assert main(["results", "fuzz", "--store", str(store)]) == 0
    assert "numpy" in capsys.readouterr().out
