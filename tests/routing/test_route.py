"""Routed runs (SPEC §14): figures computed by hand for a tiny trace, available >= captured >=
delivered, N = 1 captures all that is available, every policy's decisions held by the reference,
and each planted router fault found."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvbench.analyses.suite import config_for
from kvbench.contract.protocol import Capabilities
from kvbench.routing import policies as P
from kvbench.routing.policies import DynamoCost, Load, LongestPrefix
from kvbench.routing.route import jobs_of_trace, route
from kvbench.traces.format import load, loads

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "workloads"

# Block size 4. Requests one after another (each freed before the next):
# r0 keys [1, 2] (8 tokens), r1 [1, 2, 3] (12), r2 [7, 8] (8), r3 [1, 9] (8).
TINY = "\n".join([
    '{"kvbench_trace": 1, "family": "routing", "settings": {"block_size": 4, "num_blocks": 64, '
    '"prefix_caching": true}}',
    '{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 8, "block_hashes": [1, 2]}',
    '{"step": 1, "op": "free", "seq": 0}',
    '{"step": 2, "op": "prefill", "seq": 1, "tenant": "a", "tokens": 12, "block_hashes": [1, 2, 3]}',
    '{"step": 3, "op": "free", "seq": 1}',
    '{"step": 4, "op": "prefill", "seq": 2, "tenant": "a", "tokens": 8, "block_hashes": [7, 8]}',
    '{"step": 5, "op": "free", "seq": 2}',
    '{"step": 6, "op": "prefill", "seq": 3, "tenant": "a", "tokens": 8, "block_hashes": [1, 9]}',
    '{"step": 7, "op": "free", "seq": 3}']) + "\n"


def tiny_run(replicas, policy, **opts):
    trace = loads(TINY)
    jobs, left_out = jobs_of_trace(trace, 4)
    assert left_out == {}
    return route(jobs, config_for(trace, store_kv=False), replicas, policy, **opts)


def test_round_robin_over_two_replicas_by_hand():
    r = tiny_run(2, "round-robin")
    # r0 -> 0, r1 -> 1, r2 -> 0, r3 -> 1.
    assert r.replica.tolist() == [0, 1, 0, 1]
    # r1: replica 0 holds [1, 2] (2 blocks = 8 tokens), replica 1 nothing; r3: both hold [1]
    # (replica 1 stored [1, 2, 3]): 4 tokens, captured on replica 1 too.
    assert r.available.tolist() == [0, 8, 0, 4]
    assert r.captured.tolist() == [0, 0, 0, 4]
    assert r.delivered.tolist() == [0, 0, 0, 4]
    t = r.totals()
    assert t["prompt_tokens"] == 36  # 8 + 12 + 8 + 8
    assert (t["available"], t["captured"], t["delivered"]) == (12, 4, 4)  # 12 = 8 + 4
    assert (t["routing_gap"], t["engine_gap"]) == (8, 0)  # 8 = 12 - 4; 0 = 4 - 4
    assert r.findings == {}


def test_longest_prefix_captures_what_is_available_by_hand():
    r = tiny_run(2, "longest-prefix")
    # r0: no prefix anywhere, equal loads: replica 0; r1 holds 2 blocks there: 0; r2: none, the
    # loads are equal again (r1 finished): 0; r3: [1] on replica 0 only.
    assert r.replica.tolist() == [0, 0, 0, 0]
    assert r.available.tolist() == r.captured.tolist() == r.delivered.tolist() == [0, 8, 0, 4]
    assert r.findings == {}


@pytest.mark.parametrize("policy", list(P.POLICIES))
def test_one_replica_captures_everything_available(policy):
    r = tiny_run(1, policy)
    assert r.available.tolist() == r.captured.tolist() == [0, 8, 0, 4]


def test_an_engine_that_leaves_the_last_token_shows_the_engines_share():
    # vLLM's rule: an 8-token prompt may hit at most 7 tokens, so 1 block of 4 (7 // 4 = 1).
    trace = loads(TINY.replace('"tokens": 8, "block_hashes": [1, 9]', '"tokens": 8, "block_hashes": [1, 2]'))
    jobs, _ = jobs_of_trace(trace, 4)
    r = route(jobs, config_for(trace, store_kv=False), 1, "longest-prefix",
              capabilities=Capabilities(prefix_caching=True, rules="vllm"))
    # r1 (12 tokens, [1, 2] cached): 8 available, captured, and delivered (11 // 4 = 2 blocks);
    # r3 (8 tokens, [1, 2] cached): 8 captured, 4 delivered.
    assert r.captured.tolist() == [0, 8, 0, 8]
    assert r.delivered.tolist() == [0, 8, 0, 4]
    assert r.totals()["engine_gap"] == 4  # 16 - 12


@pytest.mark.parametrize("workload", ["prefix-reuse", "prefix-salts", "prefix-tenants", "hybrid-windows"])
@pytest.mark.parametrize("policy", list(P.POLICIES))
@pytest.mark.parametrize("replicas", [1, 3])
def test_committed_workloads_route_clean_with_the_figures_in_order(workload, policy, replicas):
    trace = load(str(WORKLOADS / f"{workload}.jsonl"))
    jobs, _ = jobs_of_trace(trace, trace.header.settings.get("block_size", 16))
    r = route(jobs, config_for(trace, store_kv=False), replicas, policy)
    assert r.findings == {}
    assert np.all(r.available >= r.captured) and np.all(r.captured >= r.delivered)
    assert np.all(r.delivered >= 0) and np.all(r.available <= r.prompt)
    if replicas == 1:
        assert np.array_equal(r.available, r.captured)


def test_the_dynamo_cost_by_hand():
    # prompt 10 blocks; replica 0: overlap 6, 20 blocks in use; replica 1: overlap 0, 2 in use.
    costs = DynamoCost(2, overlap_weight=1.0).costs([6, 0], [Load(1, 20), Load(1, 2)], 10)
    assert costs == [1.0 * (10 - 6) + 20 + 10, 1.0 * (10 - 0) + 2 + 10]  # [34, 22]: replica 1
    heavy = DynamoCost(2, overlap_weight=4.0).costs([6, 0], [Load(1, 20), Load(1, 2)], 10)
    assert heavy == [4.0 * 4 + 20 + 10, 4.0 * 10 + 2 + 10]  # [46, 52]: replica 0
    assert P.best(costs) == [1] and P.best(heavy) == [0]


def test_longest_prefix_breaks_ties_by_load():
    costs = LongestPrefix(3).costs([2, 2, 1], [Load(2, 9), Load(1, 4), Load(0, 0)], 5)
    assert P.best(costs) == [1]  # replicas 0 and 1 hold 2 blocks; 1 has 4 blocks in use, not 9


def test_a_router_that_breaks_its_policy_is_caught_by_the_reference(monkeypatch):
    made = []

    def make(name, replicas, **params):  # the router routes round robin, claiming longest prefix
        made.append(name)
        cls = P.RoundRobin if len(made) == 1 else P.LongestPrefix
        return cls(replicas, **params)

    monkeypatch.setattr(P, "make", make)
    r = tiny_run(2, "longest-prefix")
    # r1 goes to replica 1 while replica 0 holds its 2 blocks: the first wrong decision.
    assert r.findings["decision"][0] >= 1
    assert "step 2" in r.findings["decision"][1]


def wl(name):
    trace = load(str(WORKLOADS / f"{name}.jsonl"))
    jobs, _ = jobs_of_trace(trace, trace.header.settings.get("block_size", 16))
    return jobs, config_for(trace, store_kv=False)


def test_a_router_that_drops_the_salt_is_found():
    jobs, config = wl("prefix-salts")
    assert route(jobs, config, 4, "longest-prefix").findings == {}
    r = route(jobs, config, 4, "longest-prefix", plant="drop-salt")
    assert "keys" in r.findings and "index" not in r.findings


def test_a_router_with_its_own_block_size_matches_nothing_and_the_report_says_its_keys():
    jobs, config = wl("prefix-reuse")
    good = route(jobs, config, 4, "longest-prefix").totals()
    r = route(jobs, config, 4, "longest-prefix", plant="own-block-size")
    t = r.totals()
    # TensorRT-LLM 14882: its index is right (no "index" finding), its keys are not
    assert "keys" in r.findings and "index" not in r.findings
    assert t["captured"] < t["available"] and good["captured"] == good["available"]


def test_an_index_that_misses_cleared_is_found():
    jobs, config = wl("prefix-reuse")
    resets = [(20, r) for r in range(4)]  # every replica reset before request 21
    assert route(jobs, config, 4, "longest-prefix", resets=resets).findings == {}
    r = route(jobs, config, 4, "longest-prefix", resets=resets, plant="misses-cleared")
    assert "index" in r.findings


def test_an_index_that_reads_sparse_sliding_entries_as_a_prefix_is_found():
    jobs, config = wl("hybrid-windows")
    assert route(jobs, config, 4, "longest-prefix").findings == {}
    r = route(jobs, config, 4, "longest-prefix", plant="sparse-as-prefix")
    assert "index" in r.findings
