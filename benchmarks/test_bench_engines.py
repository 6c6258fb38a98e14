"""Real engines' KV-cache managers against the NumPy backend: replay time per operation, one run.

    /work/vllm-env/bin/python -m pytest benchmarks/test_bench_engines.py --benchmark-enable
    /work/sglang-env/bin/python -m pytest benchmarks/test_bench_engines.py --benchmark-enable

Skipped where no engine is installed (the engines are opt-in: see the README's recipes); each run
times the engines its environment has (``vllm-kvmanager``: vLLM's whole ``KVCacheManager``;
``sglang``: SGLang's serving default, ``UnifiedRadixCache``, and its allocator) beside ``numpy``.
Every backend keeps the ledger only (``store_kv=False``), no eviction policy, each trace under the
settings ``kvbench run`` gives it; one call replays the whole trace on a fresh backend built in the
untimed setup, through kvbench's replay driver (the asv suite's), with no checker. Traces: every committed
workload, and the Mooncake prefix-cache trace (first 500 requests, 512-token blocks, prefix caching
on, 1000 blocks) when the shared traces are present. ``extra_info``: ``us_per_op`` (median /
operations), and in the numpy row ``<engine>_vs_numpy`` = the engine's median / numpy's (above 1:
NumPy is faster).
"""
from __future__ import annotations

import dataclasses

import pytest

from kvbench.checking.driver import replay
from kvbench.contract import registry

ENGINES = [n for n in ("vllm-kvmanager", "sglang") if registry.resolve(n).available()[0]]
if not ENGINES:
    pytest.skip("neither vLLM nor SGLang is installed (opt-in): see the README's recipes",
                allow_module_level=True)

from replay_traces import replay_cases, trace_and_config  # noqa: E402

ROUNDS = {"small": 15, "mooncake": 5}
MEDIANS: dict = {}


# numpy last for each trace, so that its row can carry the ratios.
CASES = [(w, kind, impl) for w, kind in replay_cases() for impl in (*ENGINES, "numpy")]


@pytest.mark.parametrize("workload,kind,impl", CASES, ids=[f"{impl}-{w}" for w, _, impl in CASES])
def test_replay(benchmark, workload, kind, impl):
    from kvbench.checking.applicable import applicable

    trace, cfg = trace_and_config(workload)
    entry = registry.resolve(impl)
    try:
        why = applicable(trace, entry.create(dataclasses.replace(cfg)))
    except registry.BackendUnavailable as e:  # a cache kind the engine's adapter does not run
        pytest.skip(str(e))
    if why:  # a hybrid model on an engine without window groups (SGLang's RadixCache)
        pytest.skip(why)
    counts = []

    def fresh():
        return (entry.create(dataclasses.replace(cfg)), trace), {}

    def run(backend, trace):
        counts.append(replay(backend, trace))

    benchmark.group = f"replay {workload}"
    benchmark.pedantic(run, setup=fresh, rounds=ROUNDS[kind], iterations=1, warmup_rounds=1)
    assert counts[0]["evictions"] == 0  # no policy: nothing is evicted, only refused
    if benchmark.stats is None:  # --benchmark-disable
        return
    median = benchmark.stats.stats.median
    MEDIANS[(workload, impl)] = median
    benchmark.extra_info["us_per_op"] = median / len(trace.ops) * 1e6
    benchmark.extra_info["ooms"] = counts[0]["ooms"]
    if impl == "numpy":
        for engine in ENGINES:
            if (workload, engine) in MEDIANS:
                key = f"{engine.replace('-', '_')}_vs_numpy"
                benchmark.extra_info[key] = MEDIANS[(workload, engine)] / median
