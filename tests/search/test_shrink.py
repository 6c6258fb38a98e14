"""`kvbench shrink`: every planted fault, caught on a committed workload, shrinks to a handful of
operations that fail the same way; the edits keep a trace legal; passing backends and harness
errors give nothing to shrink; budgets, Ctrl-C, the header and the pytest reproducer."""
from __future__ import annotations

import dataclasses
import runpy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import A, K, P, X, make_config, make_trace
from test_faults import CASES
from test_quant_pool import BytesWithoutMetadata, CowWithoutScales

from impls.numpy_paged import NumpyPaged
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.cli import main
from kvbench.cli import shrink as shrink_cli
from kvbench.model.oracle import Oracle
from kvbench.search import edits
from kvbench.search import shrink as S
from kvbench.search.reproduce import divergence_kind
from kvbench.traces.format import Append, Fork, Free, Prefill, Trace, load, loads, validate

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"
MAX_OPS = 20  # small enough to read a failure by hand

# Each planted fault with a committed workload that catches it: (fault, workload, policy, budget
# in blocks or None for the header's, CacheConfig overrides the fault needs).
CAUGHT_ON = {
    "a-no-copy-on-write": ("fork-beam", None, None, {}),
    "a-copy-without-data": ("fork-parallel", None, None, {}),
    "b-floor": ("decode-stream", None, "12", {}),
    "c-pool-fragmentation": ("prefill-sharegpt", None, None, {}),
    "d-shared-twice": ("fork-parallel", None, None, {}),
    "e-leaky-prefill": ("prefill-alpaca", None, "12", {}),
    "e-leaky-append": ("decode-stream", None, "12", {}),
    "f-lru-ties": ("tenant-flood", "lru", None, {}),
    "g-lfu-recency": ("prefill-alpaca", "lfu", "12", {}),
    "h-fair-float": ("tenant-fractional", "fair", None, {}),
    "i-fair-under-quota": ("tenant-late", "fair", None, {}),
    "j-evicts-served": ("tenant-flood", "lru", None, {}),
    "contiguous-best-fit": ("prefill-alpaca", None, None, {"reservation": "oracle"}),
    "contiguous-fork-without-data": ("fork-beam", None, None, {"reservation": "oracle"}),
    "rollback-keeps-tail-fill": ("lifecycle-speculative", None, None, {}),
    "rejected-drafts-cached": ("lifecycle-speculative", None, None, {}),
    "chunk-cached-before-complete": ("lifecycle-chunked", None, None, {}),
    "resume-into-old-blocks": ("lifecycle-preempt", None, None, {}),
}
FAULTS = {name: CASES[name].fault for name in CAUGHT_ON}
# The quantized pool's replay faults (tests/quant/test_quant_pool.py).
FAULTS["quant-cow-without-scales"] = CowWithoutScales
CAUGHT_ON["quant-cow-without-scales"] = ("fork-beam", None, None, {"kv_format": "int8"})
FAULTS["quant-bytes-without-metadata"] = BytesWithoutMetadata
CAUGHT_ON["quant-bytes-without-metadata"] = ("decode-stream", None, None, {"kv_format": "int8"})


def setting(name):
    workload, policy, budget, overrides = CAUGHT_ON[name]
    trace = load(str(WORKLOADS / f"{workload}.jsonl"))
    config = dataclasses.replace(suite.config_for(trace, policy=policy, budget=budget), **overrides)
    return trace, config


def test_every_fault_of_the_catalogue_is_listed():
    assert set(CASES) <= set(CAUGHT_ON)


@pytest.mark.parametrize("name", sorted(CAUGHT_ON))
def test_each_planted_fault_shrinks_to_a_few_ops_failing_the_same_way(name):
    trace, config = setting(name)
    fault = FAULTS[name]
    r = S.shrink(trace, fault, config)
    assert r.status == "shrunk" and r.stopped == "done", r.summary()
    assert len(r.trace) <= MAX_OPS and len(r.trace) < len(trace), r.summary()
    # Replayed from its own text, with the settings its header records, it fails the same way,
    # at its last operation (everything after the failure was cut).
    back = loads(r.trace.to_jsonl())
    policy = suite.policies_for(back, "auto")[0]  # as `kvbench check` reads it off the header
    cfg = dataclasses.replace(suite.config_for(back, policy=policy), **CAUGHT_ON[name][3])
    v = check(back, fault(cfg))
    assert v.valid is False and divergence_kind(v.divergence) == divergence_kind(r.divergence)
    assert v.divergence.index == len(back) - 1
    # The original failure is recorded in the header, with where it happened.
    source = back.header.params["source"]
    assert (source["ops"], source["step"]) == (len(trace), r.divergence.step)
    # The same trace passes the correct backend: what it shows is the fault.
    correct = next(c for c in fault.__mro__[1:] if c.__module__.startswith("impls."))
    assert check(back, correct(cfg)).valid


def test_a_passing_backend_gives_nothing_to_shrink(tmp_path, capsys):
    trace = load(str(WORKLOADS / "fork-beam.jsonl"))
    r = S.shrink(trace, NumpyPaged, suite.config_for(trace))
    assert (r.status, r.trace, r.attempts) == ("passes", None, 1)
    assert main(["shrink", str(WORKLOADS / "fork-beam.jsonl"), "--backend", "numpy", "--quiet",
                 "--out", str(tmp_path / "x.jsonl")]) == 0
    assert "passes: nothing to shrink" in capsys.readouterr().out
    assert not (tmp_path / "x.jsonl").exists()


def test_a_harness_error_is_refused_with_its_reason(monkeypatch, tmp_path, capsys):
    def broken(self, *a, **k):
        raise RuntimeError("oracle bug")
    monkeypatch.setattr(Oracle, "fork", broken)
    trace = load(str(WORKLOADS / "fork-beam.jsonl"))
    r = S.shrink(trace, NumpyPaged, suite.config_for(trace))
    # The checker's ERROR verdict, not a FAIL of the backend: refused with its reason.
    assert r.status == "error" and r.trace is None
    assert "could not do its part: RuntimeError: oracle bug" in r.reason
    assert main(["shrink", str(WORKLOADS / "fork-beam.jsonl"), "--backend", "numpy", "--quiet",
                 "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "could not do its part: RuntimeError: oracle bug" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()


class NoFork(NumpyPaged):
    capabilities = dataclasses.replace(NumpyPaged.capabilities, fork=False)


def test_a_trace_the_backend_cannot_run_is_refused():
    trace = load(str(WORKLOADS / "fork-beam.jsonl"))
    r = S.shrink(trace, NoFork, suite.config_for(trace))
    assert r.status == "not-applicable" and "does not support fork" in r.reason


class LedgerCrashesAtThreeBlocks(NumpyPaged):
    """ledger() itself raises, outside any operation."""

    def ledger(self, seqs=None):
        led = super().ledger(seqs)
        if led.blocks_used >= 3:
            raise ZeroDivisionError("three")
        return led


class AppendRaisesOnLongBatch(NumpyPaged):
    """An append over 3 or more sequences raises (the checker turns it into a divergence)."""

    def append(self, seqs, tokens, kv=None, **kw):
        if len(seqs) >= 3:
            raise IndexError("batch too long")
        return super().append(seqs, tokens, kv, **kw)


@pytest.mark.parametrize("fault, kind, ops", [
    # 3 blocks in use: one prefill of 2 * B + 1 tokens, or three one-token prefills at B = 1.
    (LedgerCrashesAtThreeBlocks, "raises ZeroDivisionError", 3),
    # Three prefills and the append over all three.
    (AppendRaisesOnLongBatch, "raises IndexError", 4),
])
def test_a_backend_exception_shrinks_by_its_type(fault, kind, ops):
    trace = load(str(WORKLOADS / "decode-stream.jsonl"))
    r = S.shrink(trace, fault, suite.config_for(trace))
    assert r.status == "shrunk" and r.kind == kind, r.summary()
    assert len(r.trace) <= ops, r.trace.ops


def test_every_candidate_is_a_legal_trace(monkeypatch):
    runs = []

    def checked(trace, backend, **kw):
        validate(trace)  # raises on an illegal candidate
        runs.append(len(trace))
        return check(trace, backend, **kw)
    monkeypatch.setattr(S, "check", checked)
    trace, config = setting("a-copy-without-data")
    r = S.shrink(trace, FAULTS["a-copy-without-data"], config)
    assert r.ok and len(runs) == r.attempts and r.attempts > 10


def test_budgets_and_ctrl_c_keep_the_best_trace_so_far(monkeypatch):
    trace, config = setting("e-leaky-append")
    fault = FAULTS["e-leaky-append"]

    def interrupt(p):
        if p.attempts >= 8:
            raise KeyboardInterrupt
    runs = {"max-attempts": S.shrink(trace, fault, config, max_attempts=6),
            "interrupted": S.shrink(trace, fault, config, progress=interrupt)}
    now = [0.0]
    monkeypatch.setattr(S, "clock", lambda: now[0])

    def an_hour_later(p):  # once the first replay is done
        now[0] = 3600.0
    runs["max-seconds"] = S.shrink(trace, fault, config, max_seconds=60, progress=an_hour_later)
    assert runs["max-attempts"].attempts == 6 and runs["interrupted"].attempts == 8
    for stopped, r in runs.items():
        assert r.stopped == stopped and r.ok
        # Whatever it had when it stopped is legal and fails the same way.
        v = check(validate(r.trace), fault(r.shrunk_config))
        assert v.valid is False and divergence_kind(v.divergence) == r.kind


def test_max_seconds_stops_a_replay_part_way(monkeypatch):
    """A clock that moves one second each time it is read: the replay reads it after each
    operation, so a replay under way stops at the deadline instead of running on."""
    import itertools
    trace, config = setting("e-leaky-append")  # 176 operations, the fault caught at #51
    fault = FAULTS["e-leaky-append"]
    ticks = itertools.count()
    monkeypatch.setattr(S, "clock", lambda: float(next(ticks)))
    r = S.shrink(trace, fault, config, max_seconds=30)  # less than the 52 operations to #51
    assert (r.status, r.ok) == ("out-of-time", False)
    assert "did not finish within 30 s" in r.reason and "of 176 operations" in r.reason
    ticks = itertools.count()
    r = S.shrink(trace, fault, config, max_seconds=200)
    assert r.ok and r.stopped == "max-seconds"
    # Every read a second: the whole search, its last cut's grace included, took at most
    # 200 * (1 + CUT_GRACE) seconds, and a few reads more (the result's own).
    assert next(ticks) <= 200 * (1 + S.CUT_GRACE) + 5


# --- the edits ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenPrefill(Prefill):
    """A prefill with fields the format may grow: a salt and one id per token."""

    salt: str = ""
    token_ids: tuple = ()


@dataclass(frozen=True)
class TokenAppend(Append):
    token_ids: tuple = ()  # per member: one id per token


def test_dropping_a_sequence_takes_its_forks_and_their_operations():
    t = make_trace(P(0, 20), P(1, 5), K(2, 0), K(3, 2), A((0, 1), (1, 1), (3, 1)), X(2), X(1))
    out = edits.drop_sequences(t.ops, {2})
    # 2 and 3 (forked from 2) go, with the fork, 3's place in the batch and 2's free.
    assert out == [Prefill(0, 0, "a", 20), Prefill(1, 1, "a", 5), Append(4, (0, 1), (1, 1)), Free(6, 1)]
    validate(Trace(t.header, out))


def test_dropping_members_and_frees():
    t = make_trace(P(0, 20), P(1, 5), A((0, 1), (1, 2)), A((1, 3),), X(0))
    out = edits.drop_members(t.ops, [(2, 0), (3, 1), (4, 0)])
    # The second append loses its only member and goes; 0 is never freed.
    assert out == [Prefill(0, 0, "a", 20), Prefill(1, 1, "a", 5), Append(2, (1,), (2,))]


def test_new_fields_are_carried_and_cut_with_the_tokens():
    ops = [TokenPrefill(0, 0, "a", 5, ("h0",), salt="s", token_ids=(1, 2, 3, 4, 5)),
           TokenPrefill(1, 1, "a", 2, None, salt="t", token_ids=(6, 7)),
           TokenAppend(2, (0, 1), (2, 1), token_ids=((8, 9), (10,)))]
    # Prefill of 5 tokens cut to 3: 3 token ids, and the one full block of 4 is no longer full.
    cut = edits.set_tokens(ops, (0, 0), 3, block_size=4)
    assert cut[0] == TokenPrefill(0, 0, "a", 3, (), salt="s", token_ids=(1, 2, 3))
    # 0's two appended tokens cut to one: its ids follow, 1's stay.
    cut = edits.set_tokens(ops, (2, 0), 1, block_size=4)
    assert cut[2] == TokenAppend(2, (0, 1), (1, 1), token_ids=((8,), (10,)))
    # Dropping 0 drops its ids from the batch; renumbering keeps the salt.
    out = edits.renumber(edits.drop_sequences(ops, {0}))
    assert out == [TokenPrefill(0, 0, "a", 2, None, salt="t", token_ids=(6, 7)),
                   TokenAppend(1, (0,), (1,), token_ids=((10,),))]
    # An append folded into its prefill: 5 + 2 tokens, ids joined, the hashed block kept.
    folded = edits.fold_into_prefill(ops, 0)
    assert folded[0] == TokenPrefill(0, 0, "a", 7, ("h0",), salt="s", token_ids=(1, 2, 3, 4, 5, 8, 9))
    assert folded[2] == TokenAppend(2, (1,), (1,), token_ids=((10,),))


def test_merging_adjacent_appends():
    t = make_trace(P(0, 4), P(1, 4), A((0, 1), (1, 2)), A((1, 3), (0, 1)), A((0, 5),))
    out = edits.merge_appends(t.ops, 2)
    # 0 gains 1 + 1, 1 gains 2 + 3, at the first append's step.
    assert out[2:] == [Append(2, (0, 1), (2, 5)), Append(4, (0,), (5,))]
    assert edits.merge_appends(t.ops, 1) is None  # a prefill and an append


def test_renumbering_and_tenant_names_keep_the_order():
    t = make_trace(P(7, 4, "zeta"), P(3, 4, "beta"), K(9, 3), X(7))
    ops = [dataclasses.replace(op, step=op.step * 10) for op in t.ops]
    assert edits.renumber(ops) == [Prefill(0, 0, "zeta", 4), Prefill(1, 1, "beta", 4), Fork(2, 2, 1), Free(3, 0)]
    # beta < zeta, so b's ties still break before z's: a < b.
    assert edits.dense_tenant_names(edits.tenants_used(ops)) == {"beta": "a", "zeta": "b"}


# --- the command, its header and its pytest case ----------------------------------------------

def test_command_writes_the_trace_its_header_and_a_pytest_case(tmp_path, capsys):
    src = tmp_path / "fork-beam.jsonl"
    src.write_text((WORKLOADS / "fork-beam.jsonl").read_text())
    backend = "impls.faults:NoCopyOnWrite"
    assert main(["shrink", str(src), "--backend", backend, "--emit", "pytest", "--quiet"]) == 1
    out = capsys.readouterr().out
    shrunk = tmp_path / "fork-beam.min.jsonl"
    assert f"wrote {shrunk}" in out and "blocks_used" in out
    t = load(str(shrunk))
    params = t.header.params
    assert params["backend"] == backend and params["kind"] == "blocks_used"
    assert params["source"]["trace"] == str(src) and params["source"]["ops"] == 162
    assert t.header.settings["block_size"] <= 16 and len(t) <= 3  # prefill, fork, write to the tail
    # `kvbench check` replays it with the header's settings and fails the same way.
    assert main(["check", str(shrunk), "--backend", backend]) == 1
    assert "blocks_used expected" in capsys.readouterr().out
    # The pytest case fails while the backend has the bug, naming the divergence.
    test = tmp_path / "test_fork_beam_min.py"
    text = test.read_text()
    assert "# FAILS: blocks_used expected 2, actual 1" in text
    with pytest.raises(AssertionError, match="blocks_used expected 2, got 1"):
        runpy.run_path(str(test))["test_fork_beam_min"]()
    # Its operations and settings pass the correct backend.
    case = runpy.run_path(str(test))
    assert check(validate(Trace(t.header, case["OPS"])), NumpyPaged(case["CONFIG"])).valid


def test_the_header_names_the_policy_so_check_replays_only_that_one(tmp_path, capsys):
    src = tmp_path / "tenant-flood.jsonl"
    src.write_text((WORKLOADS / "tenant-flood.jsonl").read_text())
    assert main(["shrink", str(src), "--backend", "impls.faults:LruTiesWrongWay", "--quiet"]) == 1
    capsys.readouterr()
    assert main(["check", str(tmp_path / "tenant-flood.min.jsonl"),
                 "--backend", "impls.faults:LruTiesWrongWay"]) == 1
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("FAIL", "pass"))]
    assert len(lines) == 1 and "policy=lru" in lines[0]


def test_progress_lines_when_not_on_a_terminal(monkeypatch, capsys):
    report = shrink_cli._Report(quiet=False)
    report.progress.every = 0.0
    report(S.ShrinkStatus("drop sequences", 12, 162, 7, 1.5))
    err = capsys.readouterr().err
    assert err.startswith("shrink: 7 replays (") and "\r" not in err
    assert err.rstrip().endswith(", 12 ops left of 162, drop sequences)")


def test_a_history_saved_by_the_state_machines_replays_with_its_settings():
    from test_properties import FloorBlocks, check_history
    ops = [Prefill(0, 0, "a", 16), Append(1, (0,), (20,))]
    trace = validate(make_trace(P(0, 16), A((0, 20),), name="hypothesis"))
    failures = check_history(trace, make_config(16, 8), [FloorBlocks])
    path = failures[0].rsplit("history saved to ", 1)[1].rstrip(")")
    saved = load(path)
    assert saved.ops == ops and saved.header.settings["num_blocks"] == 8
    assert saved.header.params["kind"] == "blocks_used"
    v = check(saved, FloorBlocks(suite.config_for(saved)))
    assert v.valid is False and v.divergence.quantity == "blocks_used"


def test_no_numpy_scalar_leaks_into_the_header():
    # Divergence values may be numpy scalars; the header must still be JSON.
    trace, config = setting("c-pool-fragmentation")
    r = S.shrink(trace, FAULTS["c-pool-fragmentation"], config)
    assert isinstance(loads(r.trace.to_jsonl()).header.params["divergence"]["actual"], float)
    assert not isinstance(r.as_record()["shrunk_divergence"]["actual"], np.floating)


def test_a_failure_found_under_no_policy_replays_under_no_policy():
    # A tenant mix (its header names tenant weights) is replayed under all three policies by
    # default; a failure written from a run under none must say so, or `kvbench check` would
    # replay it under settings it never failed under.
    from impls.faults import FloorBlocks
    from kvbench.search.reproduce import failure_trace
    trace = load(str(WORKLOADS / "tenant-flood.jsonl"))
    assert suite.policies_for(trace, "auto") == ["lru", "lfu", "fair"]
    config = suite.config_for(trace, policy=None)
    v = check(trace, FloorBlocks(config))
    assert v.valid is False
    back = loads(failure_trace(trace, config, v.divergence, backend="floor").to_jsonl())
    assert suite.policies_for(back, "auto") == [None]
    under = suite.config_for(trace, policy="lru")
    v = check(trace, FloorBlocks(under))
    back = loads(failure_trace(trace, under, v.divergence, backend="floor").to_jsonl())
    assert suite.policies_for(back, "auto") == ["lru"]
