"""The reference index's lookups beside NVIDIA Dynamo's RadixTree on the same events, one run.

    /work/envs/dynamo/bin/python -m pytest benchmarks/test_bench_routing.py --benchmark-enable

(the environment: scripts/engine_env.sh dynamo; without Dynamo its row is skipped, saying why). The
events are those of a routed run: the Mooncake trace's first 500 requests (16-token blocks, 8
replicas of 16384 blocks, longest prefix) when the shared traces are present (``KVBENCH_TRACES``,
else ../shared/traces), else the committed
prefix-reuse workload over 4 replicas. Both indexes are fed every event (untimed), then one call
asks each request's prompt on every replica: ``extra_info``: ``lookups_per_s`` (requests a second),
and in Dynamo's row ``dynamo_vs_reference`` = Dynamo's median / the reference's (above 1: the
reference is faster). The keys are numbered for Dynamo beforehand (its input is 64-bit hashes).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvbench.analyses.suite import config_for
from kvbench.contract.protocol import CacheConfig
from kvbench.routing import dynamo
from kvbench.routing.index import ReferenceIndex, engine_keys
from kvbench.routing.route import jobs_of_requests, jobs_of_trace, route
from kvbench.traces.format import load
from kvbench.traces.loaders import load_mooncake

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = Path(os.environ.get("KVBENCH_TRACES") or ROOT.parent / "shared" / "traces") / "mooncake" / "synthetic_trace.jsonl"
MEDIANS: dict = {}


def _recorded():
    """(replicas, [(replica, events)], [request keys], config) of one routed run."""
    if MOONCAKE.exists():
        jobs = jobs_of_requests(load_mooncake(MOONCAKE)[:500], 16)
        config, replicas = CacheConfig(block_size=16, num_blocks=16384, store_kv=False,
                                       prefix_caching=True), 8
    else:
        trace = load(str(ROOT / "workloads" / "prefix-reuse.jsonl"))
        config, replicas = config_for(trace, store_kv=False), 4
        jobs, _ = jobs_of_trace(trace, config.block_size)
    stream = []
    route(jobs, config, replicas, "longest-prefix", on_events=lambda r, evs: stream.append((r, evs)))
    keys = [engine_keys(j.hashes, j.tokens, config.block_size, j.salt, j.adapter) for j in jobs]
    return replicas, stream, keys, config


RECORDED = _recorded()


@pytest.mark.parametrize("which", ["reference", "dynamo"])
def test_lookups(benchmark, which):
    why = dynamo.available() if which == "dynamo" else ""
    if why:
        pytest.skip(f"Dynamo's RadixTree does not import here ({why}); its environment: "
                    f"scripts/engine_env.sh dynamo")
    replicas, stream, keys, config = RECORDED
    if which == "reference":
        index = ReferenceIndex(replicas, config.model.kv_groups, config.block_size)
        for r, events in stream:
            index.extend(r, events)

        def ask():
            return [index.overlaps(k) for k in keys]
    else:
        index = dynamo.DynamoIndex()
        for r, events in stream:
            index.extend(r, events)
        numbered = [[index.ids.get(k, 0) for k in ks] for ks in keys]
        tree = index.tree

        def ask():
            return [tree.find_matches(n) for n in numbered]
    benchmark.pedantic(ask, rounds=5, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable
        return
    median = benchmark.stats.stats.median
    MEDIANS[which] = median
    benchmark.extra_info["lookups_per_s"] = round(len(keys) / median, 1)
    if which == "dynamo" and "reference" in MEDIANS:
        benchmark.extra_info["dynamo_vs_reference"] = round(median / MEDIANS["reference"], 3)
