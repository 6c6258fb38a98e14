"""The asv suite runs here: a benchmark that fails (rather than saying n/a) loses its history for
that commit. Run across commits, asv found two (an MLA trace's K/V buffer shaped as K and V, and a
teardown of a setup that had said n/a); these tests run what it runs, once."""
from __future__ import annotations

import importlib
import inspect
import itertools
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # asv_bench.benchmarks, a package of the repository, not of kvbench

MODULES = sorted(p.stem for p in (ROOT / "asv_bench" / "benchmarks").glob("bench_*.py"))


def suite_module(name):
    return importlib.import_module(f"asv_bench.benchmarks.{name}")


def benchmark_classes():
    """(module, class) of every asv benchmark class that computes nothing shared (setup_cache)."""
    for name in MODULES:
        mod = suite_module(name)
        for cls_name, cls in vars(mod).items():
            if inspect.isclass(cls) and not cls_name.startswith("_") and cls.__module__ == mod.__name__ \
                    and not hasattr(cls, "setup_cache") and _methods(cls):
                yield pytest.param(cls, id=f"{name}.{cls_name}")


def _methods(cls) -> list:
    return [m for m in dir(cls) if m.startswith(("time_", "peakmem_", "track_", "mem_"))]


def run_once(bench, params) -> str:
    """setup, each benchmark method, teardown, as asv calls them; 'n/a' where setup says so."""
    try:
        if hasattr(bench, "setup"):
            bench.setup(*params)
    except NotImplementedError:
        if hasattr(bench, "teardown"):
            bench.teardown(*params)  # asv tears down after an n/a setup too
        return "n/a"
    try:
        for m in _methods(type(bench)):
            getattr(bench, m)(*params)
    finally:
        if hasattr(bench, "teardown"):
            bench.teardown(*params)
    return "ran"


@pytest.mark.parametrize("cls", list(benchmark_classes()))
def test_every_benchmark_runs_its_first_case_or_says_why_not(cls):
    params = cls.params if isinstance(getattr(cls, "params", None), list) else []
    params = params if params and isinstance(params[0], list) else [params] if params else []
    first = next(itertools.product(*params)) if params else ()
    assert run_once(cls(), first) in ("ran", "n/a")


def test_every_replay_case_replays_with_kv_through_numpy():
    """The Replay benchmark (K/V written) of every case: the tier workloads alone are n/a."""
    replay = suite_module("bench_replay")
    common = suite_module("common")
    outcomes = {case: run_once(replay.Replay(), ("numpy", case)) for case in common.REPLAY_CASES}
    na = sorted(c for c, o in outcomes.items() if o == "n/a")
    tiered = sorted(w for w in common.WORKLOADS if common.load_workload(w).header.tiers)
    assert na == tiered


def test_a_tier_copy_that_setup_said_n_a_tears_down():
    tiers = suite_module("bench_tiers")
    tiers.TierCopy().teardown("torch", "host", "store", 16)  # setup raised before making anything
