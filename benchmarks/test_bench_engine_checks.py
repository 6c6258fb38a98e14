"""What checking vLLM's Mamba hybrids and speculative decoding, and the tier managers' failure
paths, costs per operation, at pools from 256 to 16,384 blocks with the trace's work fixed.

    V=/work/envs/vllm/bin/python; L=/work/envs/lmcache/bin/python
    PYTHONPATH=$PWD $V -m pytest benchmarks/test_bench_engine_checks.py --benchmark-enable -n 0
    LMCACHE_LOG_LEVEL=ERROR PYTHONPATH=$PWD $L -m pytest benchmarks/test_bench_engine_checks.py --benchmark-enable -n 0

Each row's engine is opt-in (docs/engines.md, docs/tiers-and-lifecycles.md): a row whose engine
is not installed is skipped. One call is ``check(trace, backend)`` on a fresh backend built in
the untimed setup, the trace's operations fixed and only the pool grown:

- ``vllm-kvmanager`` (vLLM's ``KVCacheManager`` and its hybrid coordinator) on variant-mamba
  (three Mamba groups and a full one) with prefix caching (``mamba_cache_mode`` "align") and
  without ("none"), and on lifecycle-speculative (drafts and accepts, full attention: kvbench's
  model rolls no drafts back over state groups, so a Mamba trace with drafts is not applicable);
  the pool is the device's ``num_blocks``.
- ``vllm-offload`` (vLLM's ``CPUOffloadingManager``; a tier whose ``failed_load`` is "drop" is
  vLLM's file tier) and ``lmcache-cpu`` (LMCache's ``LocalCPUBackend``) on tier-races (stores
  and loads failing, aborts racing them) and tier-agentic, and ``vllm-offload`` on tier-races
  with its disk tier vLLM's file tier (a failed load drops what it read); the pool is the
  tiers': each tier's capacity scaled so that the largest is the row's size, the device pool
  left as the trace has it (a larger one would serve the loads' blocks from the device, and no
  tier would be read). The boundary-tiers traces swap sequences out, which neither adapter
  does (not applicable).

``extra_info`` (medians of the rounds, per operation, this thread's CPU time):
``check_us_per_op``, the replay less the engine's own calls (its operations, the tiers'
transfers and ``attach_tiers``): the oracle, the comparisons and the adapter's reports for the
checker (ledger, block_state, tier_ledgers, events) — what the checking costs;
``reads_us_per_op``, those reports alone; ``engine_us_per_op``; ``us_per_op``, the wall median.
"""
from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from pathlib import Path

import pytest

from kvbench.analyses.suite import config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract import registry

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"
SIZES = (256, 1024, 4096, 16384)
ROUNDS = 3
# The adapter's calls that are the engine's own work, and those that report to the checker.
ENGINE_CALLS = ("prefill", "append", "fork", "free", "accept", "preempt", "resume", "load",
                "store", "complete", "abort", "lookup", "swap_in", "swap_out", "attach_tiers")
REPORTS = ("ledger", "block_state", "tier_ledgers", "events", "read_stored", "gather")

CASES = [  # (component, backend, trace, settings)
    ("mamba align", "vllm-kvmanager", "variant-mamba", {"prefix_caching": True}),
    ("mamba none", "vllm-kvmanager", "variant-mamba", {"prefix_caching": False}),
    ("speculative", "vllm-kvmanager", "lifecycle-speculative", {}),
    ("tiers", "vllm-offload", "tier-races", {}),
    ("tiers", "vllm-offload", "tier-agentic", {}),
    ("file tier", "vllm-offload", "tier-races", {"drop": "disk"}),
    ("tiers", "lmcache-cpu", "tier-races", {}),
    ("tiers", "lmcache-cpu", "tier-agentic", {}),
]


@functools.lru_cache(maxsize=None)
def trace_of(name: str):
    return load_traces([WORKLOADS / f"{name}.jsonl"])[0]


def sized(trace, settings: dict, size: int):
    """The trace and its config with the pool at ``size`` blocks: the tiers' for a tier trace,
    else the device's. ``settings["drop"]``: the tier whose failed loads drop what they read
    (vLLM's file tier, ``failed_load`` "drop")."""
    settings = dict(settings)
    drop = settings.pop("drop", None)
    cfg = config_for(trace, policy=None, **settings)
    tiers = trace.header.tiers
    if not tiers:
        return trace, dataclasses.replace(cfg, num_blocks=size)
    top = max(t.capacity for t in tiers)
    header = dataclasses.replace(trace.header, tiers=tuple(
        dataclasses.replace(t, capacity=t.capacity * size // top,
                            failed_load="drop" if t.name == drop else t.failed_load) for t in tiers))
    return dataclasses.replace(trace, header=header), cfg


def timed(backend) -> dict:
    """``backend``'s engine calls and reports, each adding this thread's CPU time to its
    total (the outermost call only: a report made inside an operation is the operation's).
    Wrapped on the instance, so that what the checker reads off the class (which lifecycles it
    implements, whether it publishes events) is unchanged."""
    spent, depth = {"engine": 0.0, "reports": 0.0}, [0]

    def wrap(fn, kind):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            depth[0] += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[kind] += time.thread_time() - start
                depth[0] -= 1
        return call

    for kind, names in (("engine", ENGINE_CALLS), ("reports", REPORTS)):
        for name in names:
            fn = getattr(backend, name, None)
            if callable(fn):
                setattr(backend, name, wrap(fn, kind))
    return spent


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("component,impl,workload,settings", CASES,
                         ids=[f"{i}-{w}-{c.replace(' ', '-')}" for c, i, w, _ in CASES])
def test_check_cost(benchmark, component, impl, workload, settings, size):
    entry = registry.resolve(impl)
    ok, why = entry.available()
    if not ok:
        pytest.skip(why)
    trace, cfg = sized(trace_of(workload), settings, size)
    rows = []

    def fresh():
        backend = entry.create(dataclasses.replace(cfg))
        return (backend, timed(backend)), {}

    def run(backend, spent):
        start = time.thread_time()
        verdict = check(trace, backend)
        rows.append((verdict, time.thread_time() - start, dict(spent)))
        backend.close()

    benchmark.group = f"checks of {impl} {component} ({workload})"
    benchmark.pedantic(run, setup=fresh, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    verdict = rows[0][0]
    assert verdict.valid is True, (verdict.not_applicable or str(verdict.divergence))
    if benchmark.stats is None:  # --benchmark-disable
        return
    n = len(trace.ops)
    timed_rows = rows[1:]  # the warm-up left out
    benchmark.extra_info.update(
        ops=n, pool_blocks=size,
        us_per_op=benchmark.stats.stats.median / n * 1e6,
        check_us_per_op=statistics.median(t - s["engine"] for _, t, s in timed_rows) / n * 1e6,
        reads_us_per_op=statistics.median(s["reports"] for _, _, s in timed_rows) / n * 1e6,
        engine_us_per_op=statistics.median(s["engine"] for _, _, s in timed_rows) / n * 1e6)
