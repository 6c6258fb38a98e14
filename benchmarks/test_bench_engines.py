"""Real engines' KV-cache managers against the NumPy backend: replay time per operation, one run.

    /work/vllm-env/bin/python -m pytest benchmarks/test_bench_engines.py --benchmark-enable
    /work/sglang-env/bin/python -m pytest benchmarks/test_bench_engines.py --benchmark-enable

Skipped where no engine is installed (the engines are opt-in: see the README's recipes); each run
times the engines its environment has (``vllm-kvmanager``: vLLM's whole ``KVCacheManager``;
``sglang-radix``: SGLang's ``RadixCache`` and allocator) beside ``numpy``. Every backend keeps the
ledger only (``store_kv=False``), no eviction policy, each trace under the settings ``kvbench run``
gives it; one call replays the whole trace on a fresh backend built in the untimed setup, through
the asv suite's replay driver, with no checker. Traces: every committed workload, and the Mooncake
prefix-cache trace (first 500 requests, 512-token blocks, prefix caching on, 1000 blocks) when
the shared traces are present. ``extra_info``: ``us_per_op`` (median / operations), and in the
numpy row ``<engine>_vs_numpy`` = the engine's median / numpy's (above 1: NumPy is faster).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from kvbench.contract import registry

ENGINES = [n for n in ("vllm-kvmanager", "sglang-radix") if registry.resolve(n).available()[0]]
if not ENGINES:
    pytest.skip("neither vLLM nor SGLang is installed (opt-in): see the README's recipes",
                allow_module_level=True)

from kvbench.analyses import prefix  # noqa: E402
from kvbench.checking.suite import committed_workloads, config_for, load_traces  # noqa: E402
from kvbench.contract.formulas import get_model  # noqa: E402
from kvbench.contract.protocol import CacheConfig  # noqa: E402
from kvbench.traces.loaders import load_requests  # noqa: E402

ROUNDS = {"small": 15, "mooncake": 5}
TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
MOONCAKE_REQUESTS, MOONCAKE_BLOCK, MOONCAKE_CACHE = 500, 512, 1000
MEDIANS: dict = {}
_traces: dict = {}


def workloads():
    cases = [(p.stem, "small") for p in committed_workloads()]
    if MOONCAKE.exists():
        cases.append(("mooncake-500", "mooncake"))
    return cases


def trace_and_config(name: str):
    if name not in _traces:
        if name == "mooncake-500":
            requests = load_requests(str(MOONCAKE), "mooncake")[:MOONCAKE_REQUESTS]
            trace = prefix.cache_trace(requests, MOONCAKE_BLOCK, name=name)
            cfg = CacheConfig(model=get_model("tiny"), block_size=MOONCAKE_BLOCK,
                              num_blocks=MOONCAKE_CACHE, store_kv=False, prefix_caching=True)
        else:
            trace = load_traces([p for p in committed_workloads() if p.stem == name])[0]
            cfg = config_for(trace, policy=None, store_kv=False)
        _traces[name] = trace, cfg
    return _traces[name]


# numpy last for each trace, so that its row can carry the ratios.
CASES = [(w, kind, impl) for w, kind in workloads() for impl in (*ENGINES, "numpy")]


@pytest.mark.parametrize("workload,kind,impl", CASES, ids=[f"{impl}-{w}" for w, _, impl in CASES])
def test_replay(benchmark, workload, kind, impl):
    from kvbench.bench.gates import bench_common  # the asv suite's replay driver, loaded by path

    trace, cfg = trace_and_config(workload)
    entry = registry.resolve(impl)
    replay = bench_common().replay
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
