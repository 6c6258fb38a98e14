"""KV events verified per second (SPEC §14) against the NumPy pool's own operation rate, in one run.

    .venv/bin/python -m pytest benchmarks/test_bench_events.py --benchmark-enable

Each committed workload with a prefix cache churning (prefix-reuse, prefix-tenants), under
``kvbench run``'s settings, ledger only. Recorded once, by a checked replay: each operation's
events and the oracle's expected changes. Timed in the same session: the pool replaying the trace
alone (kvbench.bench.fixtures.replay: its operations per second), the same replay asking the pool
for its events after every operation (what publishing them costs it), then the checker's event
verification of the recorded events (EventReplay.verify, per operation: the order rules, the
pairing of keys, the residency against the oracle's: events per second). The last row's
``extra_info`` carries ``events_per_s``, ``backend_ops_per_s``, ``events_per_backend_op`` (their
ratio: events verified in the time the pool takes one operation) and
``event_check_per_op_vs_backend``, the event check's time per operation over the pool's; the
second's ``publishing_vs_backend``, the replay with events over the replay without.
"""
from __future__ import annotations

import dataclasses

import pytest

from impls.numpy_paged import NumpyPaged
from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.bench import fixtures
from kvbench.checking.checker import check
from kvbench.checking.event_replay import EventReplay
from kvbench.model.events import ExpectedEvents

WORKLOADS = ["prefix-reuse", "prefix-tenants"]
ROUNDS = 20
MEDIANS: dict = {}


def trace_and_config(name):
    trace = load_traces([p for p in committed_workloads() if p.stem == name])[0]
    return trace, dataclasses.replace(config_for(trace), store_kv=False)


def recorded(trace, config):
    """Each operation's events and the oracle's expected changes, from one checked replay."""
    got, want = [], []

    class Recording(NumpyPaged):
        def events(self):
            out = super().events()
            got.append(out)
            return out

    changes = ExpectedEvents.changes

    def recording_changes(self):
        out = changes(self)
        want.append(out)
        return out

    ExpectedEvents.changes = recording_changes
    try:
        v = check(trace, Recording(config))
    finally:
        ExpectedEvents.changes = changes
    assert v.valid is True and v.events == sum(map(len, got)) > 0
    return got, want


class Quiet:
    """What EventReplay asks of the checker's replay, for a replay that must not diverge."""

    def diverge(self, *what, **kw):
        raise AssertionError(what)


@pytest.mark.parametrize("part", ["backend", "publishing", "events"])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_events_verified_against_the_backends_rate(benchmark, workload, part):
    trace, config = trace_and_config(workload)
    benchmark.group = f"events, {workload}"
    if part == "backend":
        def run():
            fixtures.replay(NumpyPaged(config), trace)
    elif part == "publishing":
        def run():
            pool = NumpyPaged(config)
            fixtures.replay(pool, trace, after_op=lambda op: pool.events())
    else:
        got, want = recorded(trace, config)

        def run():
            check_ = EventReplay(Quiet(), expected=object())
            for events, expected in zip(got, want):
                check_.verify(events, expected)
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable: one call, nothing measured
        return
    median = benchmark.stats.stats.median
    MEDIANS[workload, part] = median
    ops = len(trace.ops)
    if part == "backend":
        benchmark.extra_info["backend_ops_per_s"] = ops / median
        return
    if part == "publishing":
        if (workload, "backend") in MEDIANS:
            benchmark.extra_info["publishing_vs_backend"] = median / MEDIANS[workload, "backend"]
        return
    benchmark.extra_info["events_per_s"] = sum(map(len, got)) / median
    benchmark.extra_info["events_per_op"] = sum(map(len, got)) / ops
    if (workload, "backend") in MEDIANS:
        backend = MEDIANS[workload, "backend"]
        benchmark.extra_info["backend_ops_per_s"] = ops / backend
        benchmark.extra_info["event_check_per_op_vs_backend"] = median / backend
        # events verified in the time the pool takes one operation
        benchmark.extra_info["events_per_backend_op"] = (sum(map(len, got)) / median) / (ops / backend)
