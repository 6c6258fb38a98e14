"""The NumPy block pool against vLLM's own v1 BlockPool, on the same work, in one run.

    /work/vllm-env/bin/python -m pytest benchmarks/test_bench_vllm.py --benchmark-enable

Needs vLLM (opt-in: the README's recipe builds /work/vllm-env); skipped without it. Every
backend keeps the ledger only (``store_kv=False``), blocks of 16 tokens, the tiny model, no
eviction policy.

- ``alloc``: one call is the prefill of ``n * 16`` tokens (n blocks) then its free, on an empty
  pool of 1024 blocks, n in 1, 16, 256. Rows: ``numpy``, ``vllm-blockpool`` (the adapter: vLLM's
  pool plus per-sequence tables) and ``vllm-pool`` (vLLM's raw ``BlockPool``:
  ``free_blocks(get_new_blocks(n))``, the floor any vLLM-based backend pays). ``extra_info``:
  blocks/s, and in the numpy row ``numpy_vs_vllm_pool`` and ``numpy_vs_vllm_blockpool`` = their
  median time / numpy's (above 1: NumPy is faster).
- ``replay``: one call replays a whole trace on a fresh backend (built in the untimed setup),
  driven by kvbench's replay driver with no checker: every committed workload under the
  settings ``kvbench run`` gives it, and the Mooncake prefix-cache trace (first 500 requests,
  512-token blocks, prefix caching on, 1000 blocks) when /work/shared/traces is present. The numpy
  row carries ``numpy_vs_vllm_blockpool``.
"""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (opt-in): see the README's recipe for /work/vllm-env")

from impls.engines.vllm_blockpool import VllmBlockPool, _vllm  # noqa: E402
from impls.numpy_paged import NumpyPaged  # noqa: E402
from kvbench.checking.driver import replay  # noqa: E402
from kvbench.contract.formulas import get_model  # noqa: E402
from kvbench.contract.protocol import CacheConfig, Prompt  # noqa: E402
from replay_traces import replay_cases, trace_and_config  # noqa: E402

BLOCK = 16
POOL_BLOCKS = 1024
SIZES = (1, 16, 256)
ALLOC_ROUNDS, ALLOC_ITER = 200, 10
REPLAY_ROUNDS = {"small": 15, "mooncake": 5}
MEDIANS: dict = {}


def ledger_config(num_blocks=POOL_BLOCKS) -> CacheConfig:
    return CacheConfig(model=get_model("tiny"), block_size=BLOCK, num_blocks=num_blocks, store_kv=False)


# --- allocation and free of blocks ------------------------------------------------------------

def alloc_round_trip(impl: str, n: int):
    """One timed call: n blocks taken and given back."""
    if impl == "vllm-pool":
        pool = _vllm().BlockPool(num_gpu_blocks=POOL_BLOCKS + 1, enable_caching=False, hash_block_size=BLOCK)

        def call():
            pool.free_blocks(pool.get_new_blocks(n))
        return call, lambda: pool.get_num_free_blocks()
    backend = (NumpyPaged if impl == "numpy" else VllmBlockPool)(ledger_config())

    def call():
        backend.prefill(0, Prompt(n * BLOCK))
        backend.free(0)
    return call, lambda: backend.ledger().blocks_free


# numpy last in each size, so that its row can carry the ratios.
ALLOC_CASES = [(n, impl) for n in SIZES for impl in ("vllm-pool", "vllm-blockpool", "numpy")]


@pytest.mark.parametrize("n,impl", ALLOC_CASES, ids=[f"{impl}-n{n}" for n, impl in ALLOC_CASES])
def test_alloc_free(benchmark, n, impl):
    call, free_blocks = alloc_round_trip(impl, n)
    benchmark.group = f"alloc + free of {n} blocks"
    benchmark.pedantic(call, rounds=ALLOC_ROUNDS, iterations=ALLOC_ITER, warmup_rounds=5)
    assert free_blocks() == POOL_BLOCKS  # every block came back: 1024 usable, none leaked
    if benchmark.stats is None:  # --benchmark-disable
        return
    median = benchmark.stats.stats.median
    MEDIANS[("alloc", n, impl)] = median
    benchmark.extra_info["blocks_per_s"] = n / median
    if impl == "numpy":
        for other in ("vllm-pool", "vllm-blockpool"):
            if ("alloc", n, other) in MEDIANS:
                benchmark.extra_info[f"numpy_vs_{other.replace('-', '_')}"] = MEDIANS[("alloc", n, other)] / median


# --- whole traces ----------------------------------------------------------------------------

REPLAY_CASES = [(w, kind, impl) for w, kind in replay_cases() for impl in ("vllm-blockpool", "numpy")]


@pytest.mark.parametrize("workload,kind,impl", REPLAY_CASES,
                         ids=[f"{impl}-{w}" for w, _, impl in REPLAY_CASES])
def test_replay(benchmark, workload, kind, impl):
    trace, cfg = trace_and_config(workload)
    factory = NumpyPaged if impl == "numpy" else VllmBlockPool
    counts = []

    def fresh():
        return (factory(dataclasses.replace(cfg)), trace), {}

    def run(backend, trace):
        counts.append(replay(backend, trace))

    benchmark.group = f"replay {workload}"
    benchmark.pedantic(run, setup=fresh, rounds=REPLAY_ROUNDS[kind], iterations=1, warmup_rounds=1)
    assert counts[0]["evictions"] == 0  # no policy: nothing is evicted, only refused
    if benchmark.stats is None:
        return
    median = benchmark.stats.stats.median
    MEDIANS[("replay", workload, impl)] = median
    benchmark.extra_info["ops_per_s"] = len(trace.ops) / median
    benchmark.extra_info["ooms"] = counts[0]["ooms"]
    if impl == "numpy" and ("replay", workload, "vllm-blockpool") in MEDIANS:
        benchmark.extra_info["numpy_vs_vllm_blockpool"] = MEDIANS[("replay", workload, "vllm-blockpool")] / median
