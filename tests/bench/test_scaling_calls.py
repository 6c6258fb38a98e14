"""scripts/scaling.py's `calls` figure: the backend's own protocol calls timed inside a check."""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract import registry

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "scaling.py"


def _scaling():
    spec = importlib.util.spec_from_file_location("scaling_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_calls_are_timed_where_the_checker_makes_them():
    scaling = _scaling()
    trace = suite.load_traces([suite.committed_workloads()[0]])[0]
    backend = registry.create("numpy", suite.config_for(trace))
    inside = scaling._time_calls(backend)
    t0 = time.perf_counter()
    verdict = check(trace, backend)
    elapsed = time.perf_counter() - t0
    assert verdict.valid, verdict.divergence
    # the checker reads the ledger after every operation and calls the trace's operations
    assert {"prefill", "ledger"} <= set(inside), sorted(inside)
    assert all(s > 0 for s in inside.values())
    # nested inside the check, never more than it
    assert sum(inside.values()) < elapsed


def test_calls_leave_the_verdict_as_it_was():
    scaling = _scaling()
    trace = suite.load_traces([suite.committed_workloads()[0]])[0]
    cfg = suite.config_for(trace)
    plain = check(trace, registry.create("numpy", cfg)).as_dict()
    timed = registry.create("numpy", cfg)
    scaling._time_calls(timed)
    got = check(trace, timed).as_dict()
    for d in (plain, got):
        d.pop("backend_seconds")  # a time: the rest is the verdict
    assert got == plain
