"""Three verdicts, never mixed up: pass, FAIL (the backend diverged, or raised in any call), ERROR
(the harness could not do its part); a backend's exception stays its own; refused operations
cost the harness nothing."""
from __future__ import annotations

import json

import pytest
import planted
from conftest import A, K, P, X, make_config, make_trace

from impls.contiguous import Contiguous
from impls.numpy_paged import NumpyPaged
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.cli import main

ROUNDTRIP = make_trace(P(0, 40), K(1, 0), A((0, 1), (1, 1)), X(0), X(1), name="roundtrip")


@pytest.mark.parametrize("call", ["prefill", "append", "fork", "free", "ledger", "gather"])
def test_a_backend_that_raises_in_any_call_fails_naming_the_call(call):
    v = check(ROUNDTRIP, planted.raising_in(call)(make_config()), gather="all")
    assert v.status == "FAIL" and v.valid is False and not v.error
    assert v.divergence.quantity == f"outcome of {call}"
    assert v.divergence.actual == f"RuntimeError: planted: {call} raises"
    assert "planted: " + call in v.traceback and "Traceback" in v.traceback


def test_a_backend_whose_close_raises_fails():
    row = suite.run_one(ROUNDTRIP, "planted:RaisesInClose", make_config())
    assert row["status"] == "FAIL"
    assert "outcome of close expected success, got RuntimeError: planted: close raises" in row["divergence"]


def test_the_harness_running_out_of_its_own_memory_is_an_error_not_a_fail(monkeypatch):
    from kvbench.checking import checker

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 7.28 TiB")

    monkeypatch.setattr(checker, "kv_tokens", no_memory)
    v = check(ROUNDTRIP, NumpyPaged(make_config()))
    assert v.status == "ERROR" and v.valid is None and v.divergence is None
    assert "the checker could not do its part: MemoryError: Unable to allocate 7.28 TiB" in v.error
    assert "MemoryError" in v.traceback


def test_a_setting_the_oracle_cannot_model_is_an_error_of_the_run():
    # `max` reservation of 32 slots; sequence 0 reaches 41 = 40 + 1 tokens: no slab fits it.
    v = check(ROUNDTRIP, Contiguous(make_config(max_context=32, reservation="max")))
    assert v.status == "ERROR"
    assert "sequence reaches 41 tokens, beyond max_context 32" in v.error


HUGE = make_trace(P(0, 10**12), P(1, 40), A((1, 10**13),), X(1), name="huge")


@pytest.mark.parametrize("backend, fixed", [(NumpyPaged, {}), (Contiguous, {"reservation": "pow2"})])
def test_operations_the_oracle_refuses_are_never_built(backend, fixed):
    # 256 blocks of 16 tokens: 10**12 and 40 + 10**13 tokens do not fit; the checker must not
    # build 10**12 tokens of K/V (116 TiB = 10**12 * 128 B) to find out that the backend refuses them too.
    v = check(HUGE, backend(make_config(num_blocks=256, **fixed)), gather="all")
    assert v.status == "pass", str(v.divergence or v.error)
    assert v.ooms == 2


class AcceptsTooMuch(NumpyPaged):
    """Claims a prefill that does not fit succeeded (and does nothing)."""

    def prefill(self, seq, prompt, kv=None, **kw):
        if prompt.tokens > self.n_free * self.B:
            return ()
        return super().prefill(seq, prompt, kv, **kw)


def test_outcome_messages_say_what_the_oracle_expected():
    v = check(HUGE, AcceptsTooMuch(make_config(num_blocks=256)))
    assert str(v.divergence).endswith("outcome of prefill expected out-of-memory, got success "
                                      "(the oracle finds no room even after evicting every candidate)")
    # The reverse: 4 blocks, a 3-block prompt refused by a backend that thinks it has 2.
    small = make_trace(P(0, 40), name="small")

    class RefusesAll(NumpyPaged):
        def prefill(self, *a, **kw):
            from kvbench.contract.protocol import OutOfMemory
            raise OutOfMemory("planted")

    v = check(small, RefusesAll(make_config(num_blocks=4)))
    assert "outcome of prefill expected success, got out-of-memory" in str(v.divergence)


def test_a_refused_operation_that_changes_the_ledger_names_the_sequence():
    class KeepsTheRow(NumpyPaged):
        """A refused prefill leaves its sequence behind, holding nothing."""

        def prefill(self, seq, prompt, kv=None, **kw):
            try:
                return super().prefill(seq, prompt, kv, **kw)
            except Exception:
                self._new_row(seq)
                raise

    # 4 blocks: 0 takes 3 (40 tokens); 1 needs 2 of 1 free: refused, and its row stays.
    trace = make_trace(P(0, 40), P(1, 20), name="keeps")
    d = check(trace, KeepsTheRow(make_config(num_blocks=4))).divergence
    assert d.quantity == "tokens after a refused prefill"
    assert d.detail.endswith("; sequence 1: absent before, 0 tokens in 0 blocks after")


# --- the command line ---------------------------------------------------------------------------

def write(tmp_path, name, trace) -> str:
    from kvbench.traces.format import save
    path = tmp_path / f"{name}.jsonl"
    save(trace, str(path))
    return str(path)


def test_a_raising_ledger_fails_alone_and_the_record_keeps_the_traceback(tmp_path, capsys):
    trace = write(tmp_path, "roundtrip", ROUNDTRIP)
    out = tmp_path / "run.json"
    code = main(["run", trace, "--backend", "numpy", "--backend", "planted:LedgerRaises",
                 "--backend", "contiguous-oracle", "--quiet", "--output", str(out)])
    text = capsys.readouterr().out
    assert code == 1, text
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert {b: r["status"] for b, r in rows.items()} == {
        "numpy": "pass", "planted:LedgerRaises": "FAIL", "contiguous-oracle": "pass"}
    assert "ZeroDivisionError: planted: ledger() of a non-empty pool" in rows["planted:LedgerRaises"]["traceback"]
    assert ("FAIL planted:LedgerRaises on roundtrip: roundtrip: step 0 (op #0 {'step': 0, 'op': "
            "'prefill', 'seq': 0, 'tenant': 'a', 'tokens': 40}): outcome of ledger expected success, "
            "got ZeroDivisionError: planted: ledger() of a non-empty pool") in text


def test_fail_lines_name_the_policy(tmp_path, capsys):
    trace = make_trace(P(0, 16, "a"), P(1, 16, "b"), P(2, 16, "a"), name="mix", tenants={"a": 1, "b": 1})
    code = main(["run", write(tmp_path, "mix", trace), "--backend", "planted:LedgerRaises",
                 "--budget", "2", "--quiet", "--output", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert code == 1
    for policy in ("lru", "lfu", "fair"):
        assert f"FAIL planted:LedgerRaises {policy} on mix: " in text


@pytest.mark.parametrize("argv", [
    ["run", "--backend", "nosuch.mod:X"],
    ["check", "{trace}", "--backend", "impls.numpy_paged:Nope"],
    ["run", "--backend", "no-such-name"],
    ["run", "--backend", "planted:NotABackend"],
    ["run", "--backend", "planted:two_argument_factory"],
])
def test_a_backend_that_cannot_be_made_is_an_error_before_any_work(argv, tmp_path, capsys):
    trace = write(tmp_path, "roundtrip", ROUNDTRIP)
    argv = [a.replace("{trace}", trace) for a in argv]
    if argv[0] == "run":
        argv += [trace, "--output", str(tmp_path / "r.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    name = argv[argv.index("--backend") + 1]
    assert err.startswith(f"kvbench: error: --backend {name}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_factory_errors_say_what_is_wrong(tmp_path, capsys):
    trace = write(tmp_path, "roundtrip", ROUNDTRIP)
    main(["check", trace, "--backend", "planted:NotABackend"])
    assert "planted:NotABackend made a NotABackend, not a kvbench Backend" in capsys.readouterr().err
    main(["check", trace, "--backend", "planted:two_argument_factory"])
    assert ("planted:two_argument_factory(config, extra): a backend factory must take one "
            "argument, a CacheConfig") in capsys.readouterr().err


def test_a_run_where_nothing_passed_is_not_a_success(tmp_path, capsys):
    code = main(["run", write(tmp_path, "roundtrip", ROUNDTRIP), "--backend", "planted:NoFork",
                 "--quiet", "--output", str(tmp_path / "r.json")])
    captured = capsys.readouterr()
    assert code == 2
    assert "n/a  planted:NoFork on roundtrip: " in captured.out
    assert "nothing passed: every run was n/a" in captured.err


def test_allow_unavailable_runs_the_others(tmp_path, capsys):
    code = main(["run", write(tmp_path, "roundtrip", ROUNDTRIP), "--backend", "numpy",
                 "--backend", "nosuch.mod:X", "--allow-unavailable", "--quiet",
                 "--output", str(tmp_path / "r.json")])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "not run here: nosuch.mod:X: cannot import nosuch.mod:X: ModuleNotFoundError" in text
    rows = {r["backend"]: r for r in json.loads((tmp_path / "r.json").read_text())["rows"]}
    assert rows["numpy"]["status"] == "pass" and rows["nosuch.mod:X"]["status"] == "n/a"
    assert rows["nosuch.mod:X"]["unavailable"].startswith("cannot import nosuch.mod:X")
