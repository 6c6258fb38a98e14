"""What checking SGLang's UnifiedRadixCache components costs per operation, at several pool sizes.

    $S/bin/python -m pytest benchmarks/test_bench_sglang_components.py --benchmark-enable -n 0

Needs SGLang (opt-in: docs/engines.md's recipe); skipped without it. One call replays the
committed long-history trace (10,029 operations) through a fresh component tree
(impls/engines/sglang_components.py's ``replay``; building the tree is in both rows) with the
SWA or the MAMBA component, at 1, 4, 16 and 64 times the trace's pool (768 tokens), with the
per-step checks or without them. ``extra_info``: ``us_per_op`` (median / operations) and, in the
checked row, ``check_us_per_op``: the CPU time of this thread inside the checks
(``violations``), per operation, in the median round; and ``difference_us_per_op``: the checked
median less the unchecked one, per operation (on a shared machine the engine's own time moves by
more than the checks take, so this one is noisy).
"""
from __future__ import annotations

import time

import pytest

from impls.engines.sglang_radix import NOT_INSTALLED, available

if available()[1] == NOT_INSTALLED:
    pytest.skip("SGLang is not installed (opt-in): see docs/engines.md for its recipe",
                allow_module_level=True)

TRACE = "workloads/long-history.jsonl"
POOL = 48 * 16  # the trace's num_blocks x block_size
MEDIANS: dict = {}


def timed(cls):
    """``cls`` whose checks add their thread CPU time to ``spent``."""
    class Timed(cls):
        spent = 0.0

        def violations(self, full: bool = True) -> list:
            start = time.thread_time()
            try:
                return super().violations(full)
            finally:
                Timed.spent += time.thread_time() - start
    return Timed


@pytest.mark.parametrize("check", [False, True], ids=["engine", "checked"])
@pytest.mark.parametrize("mult", [1, 4, 16, 64])
@pytest.mark.parametrize("kind", ["swa", "mamba"])
def test_component_check_cost(benchmark, kind, mult, check):
    from impls.engines.sglang_components import MambaTree, SwaTree, replay
    results, spent = [], []

    def run():
        tree_cls = timed(SwaTree if kind == "swa" else MambaTree)
        results.append(replay(kind, TRACE, check=check, size=POOL * mult, tree_cls=tree_cls))
        spent.append(tree_cls.spent)

    benchmark.group = f"sglang {kind} components, pool {POOL * mult}"
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)
    assert results[0]["violations"] == []
    if benchmark.stats is None:  # --benchmark-disable
        return
    ops = results[0]["steps"]
    median = benchmark.stats.stats.median
    MEDIANS[(kind, mult, check)] = median
    benchmark.extra_info["us_per_op"] = median / ops * 1e6
    if check:
        benchmark.extra_info["check_us_per_op"] = sorted(spent[1:])[1] / ops * 1e6  # the warm-up left out
        if (kind, mult, False) in MEDIANS:
            benchmark.extra_info["difference_us_per_op"] = (
                (median - MEDIANS[(kind, mult, False)]) / ops * 1e6)
