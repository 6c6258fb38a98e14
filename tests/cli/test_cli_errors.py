"""Every bad input is refused before the work starts: one line naming the file and line, or the
option, exit 2, never a traceback; nothing but a regular file is written over; Ctrl-C (130) and
SIGTERM (143) leave no half-written file, and `run` keeps its finished runs in a record marked
partial. One case per input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import P, X, default_sigint, make_trace

from kvbench.cli import main, options
from kvbench.outputs import staged
from kvbench.traces.format import load, save

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "workloads"
TRACE = str(WORKLOADS / "fork-beam.jsonl")
MIX = str(WORKLOADS / "tenant-flood.jsonl")


def refused(argv, capsys, *, names: str) -> str:
    """Run ``kvbench argv``: exit 2, one line on stderr that names ``names``, no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("kvbench: error: ") and err.count("\n") == 1, err
    assert names in err, err
    assert "Traceback" not in err
    return err


def write_lines(tmp_path, name, lines) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


HEADER = {"kvbench_trace": 1, "family": "t"}


# --- options ---------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, option", [
    (["run", TRACE, "--block-size", "0"], "--block-size: must be a positive integer, got 0"),
    (["check", TRACE, "--max-context", "0"], "--max-context: must be a positive integer, got 0"),
    (["run", TRACE, "--block-size", "-3"], "--block-size: must be a positive integer, got -3"),
    (["prefix", TRACE, "--max-requests", "0"], "--max-requests: must be a positive integer, got 0"),
    (["prefix", TRACE, "--max-requests", "-5"], "--max-requests: must be a positive integer, got -5"),
    (["prefix", TRACE, "--sizes", "64,0"], "--sizes: '0' is not a positive size"),
    (["gates", "--blocks", "0"], "--blocks: must be a positive integer, got 0"),
    (["serve", "--trace", TRACE, "--format", "mooncake", "--max-batch", "0"], "--max-batch: must be a positive"),
    (["serve", "--trace", TRACE, "--format", "lengths", "--rate", "nan"], "--rate: must be a positive finite"),
    (["run", TRACE, "--policy", "lru2"], "--policy: invalid choice: 'lru2'"),
    (["gen", "--family", "nosuch"], "--family: invalid choice: 'nosuch'"),
    (["run", TRACE, "--no-such-option"], "unrecognized arguments: --no-such-option"),
    (["check", TRACE, "--op-timeout", "-1"], "--op-timeout: must be a finite number of seconds >= 0, got -1"),
    (["run", TRACE, "--op-timeout", "soon"], "--op-timeout: must be a number of seconds, got 'soon'"),
])
def test_a_bad_option_value_is_one_line(argv, option, capsys):
    refused(argv, capsys, names=option)


@pytest.mark.parametrize("argv, names", [
    (["run", TRACE, "--block-size", "99999999999999999999999"],
     "--block-size: must be at most 2,147,483,647, got 99999999999999999999999"),  # 2**31 - 1
    (["run", TRACE, "--backend", "os:path"],
     "--backend os:path: os:path is a module, not a backend factory"),
    (["results", "any", "--agg", "bogus"], "--agg: invalid choice: 'bogus'"),
])
def test_an_option_the_backend_would_have_failed_on(argv, names, capsys):
    refused(argv, capsys, names=names)


@pytest.mark.parametrize("budget", ["100B", "0"])
def test_a_budget_under_one_block(budget, capsys):
    # fork-beam: the tiny model, 128 B per token; a block of 16 tokens is 2048 = 16 * 128 bytes.
    err = refused(["run", TRACE, "--budget", budget, "--backend", "numpy"], capsys,
                  names=f"--budget {budget}: less than one block")
    assert "is 2,048 bytes" in err


def test_a_budget_that_is_not_a_size(capsys):
    refused(["check", TRACE, "--budget", "lots"], capsys, names="--budget: not a byte size: 'lots'")


def test_a_budget_beyond_the_machine_runs_ledger_only_with_a_note(tmp_path, capsys):
    # llama-3-8b: 128 KiB a token, 2 MiB a block of 16: 1 TiB is 524,288 blocks of K/V.
    out = tmp_path / "r.json"
    code = main(["run", TRACE, "--budget", "1TiB", "--model", "llama-3-8b", "--backend", "numpy",
                 "--quiet", "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "more than this machine's" in text and "running ledger-only" in text
    row = json.loads(out.read_text())["rows"][0]
    assert row["status"] == "pass" and "store_kv is off" in row["skipped"]


def test_a_budget_whose_bookkeeping_alone_does_not_fit_is_refused(capsys):
    # The tiny model: 2 KiB a block; 64 TiB is 2**46 / 2**11 = 2**35 blocks.
    refused(["run", TRACE, "--budget", "64TiB"], capsys,
            names="--budget 64TiB: 34,359,738,368 blocks of 16 tokens of tiny: even a ledger-only")


def test_an_unknown_metric_lists_the_valid_ones(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path in (a, b):
        assert main(["run", TRACE, "--backend", "numpy", "--quiet", "--output", str(path)]) == 0
    capsys.readouterr()
    err = refused(["compare", str(a), str(b), "--metric", "nonsense", "--no-charts"], capsys,
                  names="--metric nonsense: not a column of these records; valid: ")
    assert "peak_blocks" in err and "evictions" in err


def test_compare_names_a_file_that_is_not_a_record(tmp_path, capsys):
    a = tmp_path / "a.json"
    assert main(["run", TRACE, "--backend", "numpy", "--quiet", "--output", str(a)]) == 0
    capsys.readouterr()
    refused(["compare", str(a), TRACE, "--no-charts"], capsys,
            names=f"{TRACE}: not a kvbench result record (not a JSON document")


# --- traces ----------------------------------------------------------------------------------

def test_an_id_outside_int64(tmp_path, capsys):
    path = write_lines(tmp_path, "big.jsonl", [HEADER, {"step": 0, "op": "prefill", "seq": 10**22,
                                                         "tenant": "a", "tokens": 4}])
    refused(["check", path, "--backend", "numpy"], capsys,
            names=f"{path}:2: field 'seq' = {10**22} is outside int64")


def test_an_id_outside_int64_in_a_batch(tmp_path, capsys):
    path = write_lines(tmp_path, "big.jsonl", [
        HEADER, {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 4},
        {"step": 1, "op": "append", "seqs": [0], "tokens": [2**63]}])
    refused(["check", path, "--backend", "numpy"], capsys,
            names=f"{path}:3: field 'tokens[0]' = {2**63} is outside int64")


def test_an_undeclared_tenant(tmp_path, capsys):
    path = write_lines(tmp_path, "mix.jsonl", [
        {**HEADER, "tenants": {"a": 1, "b": 2}},
        {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 4},
        {"step": 1, "op": "prefill", "seq": 1, "tenant": "c", "tokens": 4}])
    refused(["run", path, "--backend", "numpy"], capsys,
            names=f"{path}:3: tenant 'c' is not declared in the header's 'tenants' ('a', 'b')")


def test_more_block_hashes_than_full_blocks(tmp_path, capsys):
    # 40 tokens in blocks of 16: 2 full blocks (32 tokens) and 8 more; 3 hashes are one too many.
    path = write_lines(tmp_path, "h.jsonl", [
        HEADER, {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40,
                 "block_hashes": [1, 2, 3]}])
    refused(["check", path, "--backend", "numpy"], capsys,
            names=f"{path}:2: 3 block_hashes for 40 tokens: a prompt of 40 tokens has 2 full blocks of 16")


PREFILL = {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40}


@pytest.mark.parametrize("header, names", [
    ({"settings": {"block_size": "huge"}},
     "setting 'block_size' must be a positive integer (at most 2,147,483,647), got 'huge'"),
    ({"settings": {"block_size": 0}}, "setting 'block_size' must be a positive integer"),
    ({"settings": {"num_blocks": 0}}, "setting 'num_blocks' must be a positive integer, got 0"),
    ({"settings": {"block_size": 2.5}}, "setting 'block_size' must be a positive integer"),
    ({"settings": {"num_blocks": True}}, "setting 'num_blocks' must be a positive integer, got True"),
    ({"settings": {"block_size": []}}, "setting 'block_size' must be a positive integer"),
    ({"settings": {"prefix_caching": "yes"}}, "setting 'prefix_caching' must be true or false"),
    ({"settings": {"budget": "1GiB"}}, "unknown setting 'budget' (the settings: model, block_size"),
    ({"settings": "abc"}, "header field 'settings' must be an object, got 'abc'"),
    ({"settings": {"model": "nope"}}, "setting 'model': unknown model 'nope'; known: "),
    ({"settings": {"policy": "mru"}}, "setting 'policy': 'mru' is not a policy (lru, lfu, fair, none)"),
    ({"groups": ["sliding(0)"]}, "'groups': 'sliding(0)': a sliding window is at least 1 token"),
    # Beyond int64 (2**63 - 1 = 9,223,372,036,854,775,807): the header's, not the backend's.
    ({"groups": ["sliding(99999999999999999999999)", "full"]},
     "'groups': 'sliding(99999999999999999999999)': window = 99999999999999999999999 is outside "
     "int64 (at most 9,223,372,036,854,775,807)"),
    ({"groups": ["state(99999999999999999999)", "full"]},
     "'groups': 'state(99999999999999999999)': state_bytes = 99999999999999999999 is outside "
     "int64 (at most 9,223,372,036,854,775,807)"),
    ({"groups": ["sinks(4,9223372036854775808)", "full"]},  # 2**63
     "'groups': 'sinks(4,9223372036854775808)': W = 9223372036854775808 is outside int64"),
    ({"groups": ["full", "full", "full"]},  # the tiny model's 2 layers
     "'groups': model 'tiny': 2 layers do not split into 3 groups"),
    ({"groups": []}, "'groups' must be a non-empty list of group kinds"),
    ({"tenant": {"a": 1}}, "unknown header field 'tenant' (the header's fields: kvbench_trace"),
])
def test_header_settings_are_typed(header, names, tmp_path, capsys):
    path = write_lines(tmp_path, "h.jsonl", [{**HEADER, **header}, PREFILL])
    refused(["check", path, "--backend", "numpy"], capsys, names=f"{path}:1: {names}")


@pytest.mark.parametrize("line, names", [
    ({**PREFILL, "block_hashes": [{"a": 1}]},
     "2: block_hashes[0] must be an integer or a non-empty string, got {'a': 1}"),
    ({**PREFILL, "block_hash": [1, 2]},  # the typo would have turned prefix caching off
     "2: unknown field 'block_hash' of op 'prefill' (its fields: adapter, block_hashes, "),
    ('{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40, "tokens": 4}',
     "2: not valid JSON for kvbench: key 'tokens' is given twice"),
    ("[" * 10**5 + "]" * 10**5, "2: not valid JSON for kvbench: nested too deeply"),
    ({"step": 1, "op": "append", "seqs": [0], "tokens": [1], "tenant": "a"},
     "3: unknown field 'tenant' of op 'append'"),
])
def test_a_field_that_would_be_ignored_or_crash_later(line, names, tmp_path, capsys):
    lines = [json.dumps(HEADER), json.dumps(PREFILL) if "append" in str(line) else None,
             line if isinstance(line, str) else json.dumps(line)]
    path = tmp_path / "f.jsonl"
    path.write_text("".join(x + "\n" for x in lines if x is not None))
    refused(["check", str(path), "--backend", "numpy"], capsys, names=f"{path}:{names}")


def test_an_extra_csv_column(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text(f"# {json.dumps(HEADER)}\nstep,op,seq,tenant,tokens,src,note\n0,prefill,0,a,4,,x\n")
    refused(["check", str(path), "--backend", "numpy"], capsys,
            names=f"{path}:2: columns must be ['step', 'op', 'seq', 'tenant', 'tokens', 'src'], got")


@pytest.mark.parametrize("command", ["check", "prefix"])
def test_a_device_is_not_read_forever(command, capsys):
    refused([command, "/dev/zero"], capsys, names="/dev/zero: a character device, not a trace file")


def test_a_binary_file(tmp_path, capsys):
    path = tmp_path / "garbage.jsonl"
    path.write_bytes(b'{"kvbench_trace": 1, "family": "t"}\n\x89PNG\r\n\x1a\n\xff\xfe\x00')
    refused(["check", str(path)], capsys, names=f"{path}:2: not UTF-8 text (byte 0x89 at column 1)")


def test_a_file_with_a_byte_order_mark(tmp_path, capsys):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(HEADER).encode() + b"\n")
    refused(["run", str(path)], capsys, names=f"{path}:1: the file starts with a UTF-8 byte-order mark")


def test_a_binary_request_trace(tmp_path, capsys):
    path = tmp_path / "req.jsonl"
    path.write_bytes(b'{"timestamp": 0}\n\xff\xff')
    refused(["prefix", str(path)], capsys, names=f"{path}:2: not UTF-8 text (byte 0xff)")


@pytest.mark.parametrize("command", ["run", "check"])
def test_a_trace_of_a_header_only_checks_nothing(command, tmp_path, capsys):
    path = write_lines(tmp_path, "empty.jsonl", [HEADER])
    refused([command, path, "--backend", "numpy"], capsys,
            names=f"{path}: no operations after the header: nothing to check")


def test_a_missing_trace_file(tmp_path, capsys):
    refused(["check", str(tmp_path / "nope.jsonl")], capsys,
            names=f"{tmp_path / 'nope.jsonl'}: No such file or directory")


# --- outputs, checked before the work --------------------------------------------------------

def blocker(tmp_path) -> Path:
    """A file where a folder would have to be: nothing can be written under it (even as root)."""
    path = tmp_path / "a-file"
    path.write_text("x")
    return path


@pytest.mark.parametrize("argv, option", [
    (["run", TRACE, "--backend", "numpy", "--output", "{b}/run.json"], "--output"),
    (["serve", "--scenario", "opt13b", "--paper-out", "{b}/paper"], "--paper-out"),
    (["serve", "--scenario", "opt13b", "--plot", "{b}/x.png"], "--plot"),
    (["eviction", MIX, "--out", "{b}/ev"], "--out"),
    (["gen", "--family", "fork_trees", "--out", "{b}/t.jsonl"], "--out"),
    (["compare", "{r}", "{r}", "--out", "{b}/charts"], "--out"),
])
def test_an_output_that_cannot_be_written_is_refused_first(argv, option, tmp_path, capsys):
    b = blocker(tmp_path)
    record = tmp_path / "r.json"
    if "compare" in argv:
        main(["run", TRACE, "--backend", "numpy", "--quiet", "--output", str(record)])
        capsys.readouterr()
    argv = [a.replace("{b}", str(b)).replace("{r}", str(record)) for a in argv]
    t0 = time.perf_counter()
    err = refused(argv, capsys, names=f"{option}: {b}/")
    assert "cannot be written" in err
    assert time.perf_counter() - t0 < 10  # before the work (a scenario run takes minutes)


def test_an_output_that_is_a_folder(tmp_path, capsys):
    refused(["run", TRACE, "--backend", "numpy", "--output", str(tmp_path)], capsys,
            names=f"--output: {tmp_path} is a folder; give a file name")


# --- outputs: nothing destroyed, nothing lost -------------------------------------------------

def special_file(kind, tmp_path) -> Path:
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return tmp_path / "fifo"
    if kind == "link":  # /dev/stdout is one: a rename would replace the link with a file
        (tmp_path / "target.json").write_text("kept")
        (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
        return tmp_path / "link.json"
    return Path(kind)


@pytest.mark.parametrize("kind, what", [("/dev/null", "a character device"),
                                        ("/dev/full", "a character device"),
                                        ("fifo", "a FIFO"), ("link", "a symbolic link")])
def test_an_output_that_is_not_a_regular_file_is_left_untouched(kind, what, tmp_path, capsys):
    path = special_file(kind, tmp_path)
    before = os.lstat(path)
    refused(["run", TRACE, "--backend", "numpy", "--quiet", "--output", str(path)], capsys,
            names=f"--output: {path} is {what}: kvbench writes only regular files")
    after = os.lstat(path)
    assert (after.st_mode, after.st_ino, after.st_rdev) == (before.st_mode, before.st_ino, before.st_rdev)


def test_dash_as_output_is_stdout(tmp_path):
    got = run_module("kvbench.cli", "run", TRACE, "--backend", "numpy", "--quiet", "--output", "-")
    assert got.returncode == 0, got.stderr
    rec = json.loads(got.stdout)  # the record alone: the table went to stderr
    assert rec["kind"] == "run" and [r["workload"] for r in rec["rows"]] == ["fork-beam"]
    assert "results in -" in got.stderr and not (ROOT / "-").exists()


def test_two_records_written_in_one_second_get_two_names(tmp_path, monkeypatch):
    from kvbench.bench import records
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    rec = records.record("run", [], {})  # one "created" second for both
    first, second = records.write(rec), records.write(rec)
    assert first != second and first.exists() and second.exists()
    assert f"-{os.getpid()}-" in first.name


def test_an_io_error_writing_the_record_names_the_file(tmp_path):
    import resource

    def small_files():  # files of at most 4 KiB: the record (about 7 KiB) fails as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    out = tmp_path / "r.json"
    got = run_module("kvbench.cli", "run", TRACE, "--backend", "numpy", "--quiet", "--output",
                     str(out), preexec_fn=small_files)
    assert got.returncode == 2, got.stderr
    assert got.stderr == f"kvbench: error: {out}: File too large\n"
    assert list(tmp_path.iterdir()) == []


# --- shrink --------------------------------------------------------------------------------

def test_shrink_stopped_at_once_still_cuts_after_the_failure(tmp_path, capsys, monkeypatch):
    from kvbench.search import shrink as S
    src = tmp_path / "tenant-flood.jsonl"
    src.write_text(Path(MIX).read_text())
    out = tmp_path / "min.jsonl"
    now, first_replay = [0.0], S.replay

    def replay(*args, **kw):  # the first replay takes all of --max-seconds 10
        outcome = first_replay(*args, **kw)
        now[0] = 10.0
        return outcome
    monkeypatch.setattr(S, "replay", replay)
    monkeypatch.setattr(S, "clock", lambda: now[0])
    assert main(["shrink", str(src), "--backend", "impls.faults:LruTiesWrongWay", "--quiet",
                 "--max-seconds", "10", "--out", str(out)]) == 1  # no time past the first replay
    capsys.readouterr()
    shrunk = load(str(out))
    source = shrunk.header.params["source"]
    assert source["stopped"] == "max-seconds" and source["index"] + 1 < source["ops"]
    assert len(shrunk) == source["index"] + 1  # every operation after the first divergence dropped


# --- grids, checked before their first cell --------------------------------------------------

@pytest.mark.parametrize("backends, extra, names", [
    ('["numpy", "nosuch"]', "", "backends: unknown backend 'nosuch'; known: numpy"),
    ('["numpy"]', '[settings]\nblock_size = [16, "abc"]\n',
     "settings.block_size[1]: must be a positive integer (at most 2,147,483,647), got 'abc'"),
    ('["numpy"]', '[settings]\npolicy = "mru"\n', "settings.policy[0]: must be one of auto, all, "),
    ('["numpy"]', '[[exclude]]\nbackend = "numpy"\n', "no cells: the exclude rules remove every one"),
])
def test_a_grid_is_refused_before_its_first_cell(backends, extra, names, tmp_path, capsys):
    save(make_trace(P(0, 40), X(0), name="hand"), str(tmp_path / "hand.jsonl"))
    grid = tmp_path / "g.toml"
    grid.write_text(f'name = "g"\nbackends = {backends}\n[[traces]]\npath = "hand.jsonl"\n{extra}')
    store = tmp_path / "store"
    refused(["sweep", str(grid), "--store", str(store), "--quiet"], capsys, names=f"{grid}: {names}")
    assert not store.exists() or not any(store.rglob("*.parquet"))  # no cell ran


# --- gates -----------------------------------------------------------------------------------

def test_gates_use_the_names_of_kvbench_list(capsys):
    refused(["gates", "--backend", "torch-cpu", "--skip-ratios"], capsys,
            names="--backend torch-cpu: not a gated backend; gated (as `kvbench list` names them): "
                  "numpy, torch, contiguous-max")


def test_gates_without_the_expected_file(tmp_path, capsys):
    refused(["gates", "--expected", str(tmp_path / "none.json")], capsys,
            names=f"--expected {tmp_path / 'none.json'}: no such file")


def test_gates_case_that_matches_nothing(capsys):
    refused(["gates", "--case", "nosuch", "--skip-ratios"], capsys, names="--case nosuch: no such replay case")


def test_gates_with_everything_skipped(capsys):
    refused(["gates", "--skip-exact", "--skip-ratios"], capsys, names="--skip-exact: nothing left to check")


# --- the other entry points: the same error path -----------------------------------------------

def run_module(*args, **kw):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, **kw)


@pytest.mark.parametrize("args, names", [
    (["kvbench.cli.gpu", "--device", "cpu", "--size", "tiny", "--traces", "/nonexistent.jsonl"],
     "/nonexistent.jsonl: No such file or directory"),
    (["kvbench.cli.gpu", "--device", "nosuch"], "--device nosuch: "),
    (["kvbench.cli.gpu", "--device", "cpu", "--out", "/proc/version/x"], "--out: /proc/version/x"),
    (["kvbench.cli.gates", "--blocks", "0"], "--blocks: must be a positive integer, got 0"),
    (["kvbench.bench.compare", "/nonexistent.json", "/nonexistent.json"], "/nonexistent.json: No such file"),
    (["kvbench.cli", "eviction", "/nonexistent.jsonl"], "/nonexistent.jsonl: No such file"),
    (["kvbench.cli", "eviction", MIX, "--backend", "nosuch"], "--backend nosuch: unknown backend"),
])
def test_every_entry_point_takes_the_one_error_path(args, names):
    pytest.importorskip("torch")
    got = run_module(*args)
    assert got.returncode == 2, got.stderr
    prog = "python -m kvbench.cli.gpu" if args[0] == "kvbench.cli.gpu" else "kvbench"
    assert got.stderr.startswith(f"{prog}: error: ") and names in got.stderr, got.stderr
    assert got.stderr.count("\n") == 1 and "Traceback" not in got.stderr


def test_debug_shows_the_traceback(capsys):
    assert main(["--debug", "check", "/nonexistent.jsonl"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().endswith("/nonexistent.jsonl: No such file or directory")


# --- interrupts ------------------------------------------------------------------------------

def test_an_interrupt_is_one_line_and_exit_130(capsys):
    def interrupted(argv):
        raise KeyboardInterrupt

    assert options.run(interrupted, []) == 130
    assert capsys.readouterr().err == "kvbench: interrupted\n"


def test_staged_outputs_leave_nothing_when_interrupted(tmp_path):
    paths = [tmp_path / "breakdown.csv", tmp_path / "breakdown.md", tmp_path / "breakdown.png"]
    with pytest.raises(KeyboardInterrupt):
        with staged(*paths) as temps:
            temps[0].write_text("a,b\n")
            temps[1].write_text("# table\n")
            raise KeyboardInterrupt  # before the chart
    assert list(tmp_path.iterdir()) == []
    with staged(*paths) as temps:
        for t in temps:
            t.write_text("done")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)


@pytest.mark.parametrize("signum, code, word", [(signal.SIGINT, 130, "interrupted"),
                                                  (signal.SIGTERM, 143, "terminated")])
def test_a_signal_during_a_run_keeps_the_finished_runs(signum, code, word, tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.Popen([sys.executable, "-m", "kvbench.cli", "run", "--output", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    # The first progress line (every 5 s in a log, after a run finished): past the imports,
    # inside the replay, however loaded the machine is (the default run takes about a minute).
    first = proc.stderr.readline()
    assert first.startswith("replaying:"), first
    finished = int(first.split()[1].split("/")[0])  # "replaying: 3/175 runs (5 s)"
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stderr
    assert stderr.endswith(f"kvbench: {word}\n") and "Traceback" not in stderr
    rec = json.loads(out.read_text())
    assert rec["partial"] == f"{word} after {len(rec['rows'])} runs" and len(rec["rows"]) >= finished
    assert f"are in {out} (a partial record)" in stderr
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]  # no temporary file


def test_save_leaves_no_partial_trace(tmp_path, monkeypatch):
    trace = make_trace(P(0, 4), X(0))
    path = tmp_path / "t.jsonl"

    def broken_lines():
        yield json.dumps(trace.header.to_dict()) + "\n"
        raise KeyboardInterrupt

    monkeypatch.setattr(type(trace), "jsonl_lines", lambda self: broken_lines())
    with pytest.raises(KeyboardInterrupt):
        save(trace, str(path))
    assert os.listdir(tmp_path) == []


# --- help -------------------------------------------------------------------------------------

def test_every_command_and_argument_has_help(capsys):
    import argparse

    from kvbench.cli import parser
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    helps = {a.dest: a.help for a in sub._choices_actions}
    missing = [name for name in sub.choices if not helps.get(name)]
    missing += [f"{name} {a.option_strings or a.dest}" for name, sp in sub.choices.items()
                for a in sp._actions if not isinstance(a, argparse._HelpAction) and not a.help]
    assert missing == []
    with pytest.raises(SystemExit):
        main(["gen", "--help"])
    text = capsys.readouterr().out
    from kvbench.traces.generators import FAMILIES
    assert all(f in text for f in FAMILIES)
