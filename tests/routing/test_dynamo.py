"""NVIDIA Dynamo's RadixTree fed the replicas' events, its matches held to the reference index at
every request (opt-in: its environment is scripts/engine_env.sh dynamo; skipped elsewhere)."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.analyses.suite import config_for
from kvbench.contract.events import CLEARED, REMOVED, STORED, KVEvent
from kvbench.routing import dynamo
from kvbench.routing.route import jobs_of_trace, route
from kvbench.traces.format import load

pytestmark = pytest.mark.skipif(bool(dynamo.available()), reason=f"Dynamo's RadixTree: {dynamo.available()}")
WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def test_dynamos_tree_answers_hand_written_events():
    tree = dynamo.DynamoIndex()
    tree.extend(0, [KVEvent(STORED, "a"), KVEvent(STORED, "b", "a")])
    tree.extend(1, [KVEvent(STORED, "a")])
    assert tree.overlaps(("a", "b", "c"), 2) == [2, 1]
    tree.apply(0, KVEvent(REMOVED, "b"))
    assert tree.overlaps(("a", "b"), 2) == [1, 1]
    tree.apply(1, KVEvent(CLEARED))
    assert tree.overlaps(("a", "b"), 2) == [1, 0]


@pytest.mark.parametrize("workload", ["prefix-reuse", "prefix-salts", "prefix-tenants"])
def test_dynamos_tree_agrees_with_the_reference_at_every_request(workload):
    trace = load(str(WORKLOADS / f"{workload}.jsonl"))
    jobs, _ = jobs_of_trace(trace, trace.header.settings.get("block_size", 16))
    r = route(jobs, config_for(trace, store_kv=False), 4, "dynamo", dynamo=True,
              resets=[(len(jobs) // 2, 0)])
    assert r.dynamo_checked == len(jobs)
    assert r.findings == {}
