"""The traces the replay benchmarks share (test_bench_vllm.py, test_bench_engines.py): every
committed workload under the settings ``kvbench run`` gives it (ledger only, no policy), and the
Mooncake prefix-cache trace (first 500 requests, 512-token blocks, prefix caching on, 1000
blocks) when the shared traces are present."""
from __future__ import annotations

import functools
import os
from pathlib import Path

from kvbench.analyses import prefix
from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.contract.formulas import get_model
from kvbench.contract.protocol import CacheConfig
from kvbench.traces.loaders import load_requests

TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
MOONCAKE_REQUESTS, MOONCAKE_BLOCK, MOONCAKE_CACHE = 500, 512, 1000


def replay_cases() -> list:
    """(name, kind): kind "small" for a committed workload, "mooncake" for the shared trace.
    The tier workloads are left out: their transfers are the checker's alone (SPEC §11)."""
    cases = [(p.stem, "small") for p in committed_workloads()
             if not load_traces([p])[0].header.tiers]
    if MOONCAKE.exists():
        cases.append(("mooncake-500", "mooncake"))
    return cases


@functools.lru_cache(maxsize=None)
def trace_and_config(name: str):
    if name == "mooncake-500":
        requests = load_requests(str(MOONCAKE), "mooncake")[:MOONCAKE_REQUESTS]
        trace = prefix.cache_trace(requests, MOONCAKE_BLOCK, name=name)
        cfg = CacheConfig(model=get_model("tiny"), block_size=MOONCAKE_BLOCK,
                          num_blocks=MOONCAKE_CACHE, store_kv=False, prefix_caching=True)
    else:
        trace = load_traces([p for p in committed_workloads() if p.stem == name])[0]
        cfg = config_for(trace, policy=None, store_kv=False)
    return trace, cfg
