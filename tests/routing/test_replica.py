"""A replica's events (SPEC §14 residency): replayed under the order rules, they give exactly the
oracle's prefix cache after every operation, evictions, sliding windows and a reset included."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.analyses.suite import config_for
from kvbench.contract.events import Residency
from kvbench.routing.index import engine_keys
from kvbench.routing.replica import Replica
from kvbench.routing.route import jobs_of_trace
from kvbench.traces.format import load

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def residency_matches(replica, replay):
    replay.extend(replica.events())
    groups = range(len(replica.oracle.groups))
    assert {g: replay.keys(g) for g in groups} == \
        {g: frozenset(k for gg, k in replica.oracle.by_hash if gg == g) for g in groups}


@pytest.mark.parametrize("workload", ["prefix-reuse", "prefix-salts", "hybrid-windows", "hybrid-cut-hits"])
def test_events_replay_to_the_oracles_prefix_cache(workload):
    trace = load(str(WORKLOADS / f"{workload}.jsonl"))
    config = config_for(trace, store_kv=False)
    jobs, _ = jobs_of_trace(trace, config.block_size)
    replica, replay = Replica(config), Residency()
    for step, job in enumerate(jobs):
        for seq in [s for s, finish in replica.live.items() if finish <= job.arrival]:
            replica.finish(seq)
            residency_matches(replica, replay)
        if step == len(jobs) // 2:
            replica.reset()
            residency_matches(replica, replay)
            assert replay.keys(0) == frozenset()
        replica.serve(job.index, job, engine_keys(job.hashes, job.tokens, config.block_size,
                                                  job.salt, job.adapter), step)
        residency_matches(replica, replay)
    assert replay.count > 0


def test_a_replica_whose_pool_announces_its_own_events_passes_them_on_and_a_reset_once():
    trace = load(str(WORKLOADS / "prefix-reuse.jsonl"))
    replica = Replica(config_for(trace, store_kv=False))
    own = [[], ["its own"]]
    replica.reset()
    replica.oracle.events = lambda: own.pop(0)  # a pool with events() (SPEC §14's protocol)
    first = replica.events()
    assert [e.kind for e in first] == ["cleared"]
    assert replica.events() == ["its own"]  # the reset's cleared is not announced twice


def test_a_replica_keeps_no_record_per_prompt_beyond_its_cache():
    # Ledger-only: no map of the writers of every block it ever served (the oracle's, for a
    # content leak check), and the parents it knows are those of the prompt it served last:
    # what it holds is bounded by its cache, not by the trace (1.2 GB over the Mooncake trace).
    trace = load(str(WORKLOADS / "prefix-salts.jsonl"))
    config = config_for(trace, store_kv=False)
    jobs, _ = jobs_of_trace(trace, config.block_size)
    replica, replay = Replica(config), Residency()
    for job in jobs:
        for seq in list(replica.live):
            replica.finish(seq)
        keys = engine_keys(job.hashes, job.tokens, config.block_size, job.salt, job.adapter)
        replica.serve(job.index, job, keys, job.index)
        residency_matches(replica, replay)
    assert len(jobs) > 1 and any(j.salt for j in jobs)
    assert replica.oracle.writers == {}
    assert set(replica.oracle.parent_of) == set(keys)
