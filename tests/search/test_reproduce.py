"""The pytest case `kvbench shrink --emit pytest` and `kvbench fuzz` write (emit_pytest): it
replays the trace as it failed, tiers included, and a case of an engine's skips where the engine
is not installed."""
from __future__ import annotations

import runpy

from conftest import make_config

from impls.numpy_paged import NumpyPaged
from kvbench.contract import registry
from kvbench.search.reproduce import emit_pytest
from kvbench.traces.format import Header, Prefill, Trace, validate
from kvbench.traces.ops import Abort, Preempt
from kvbench.traces.tier_ops import TierSpec


def write_case(tmp_path, trace, config, backend: str) -> dict:
    path = tmp_path / "test_case_min.py"
    path.write_text(emit_pytest(trace, NumpyPaged, config, backend))
    return runpy.run_path(str(path))


def test_the_case_keeps_the_traces_tiers(tmp_path):
    # results/fuzz/campaigns/earlier/numpy/01's minimal trace: an abort of a preempted sequence
    # with one host tier. Without its tier the replay has no tier to run the abort on (the
    # case's verdict was a harness error, not the pass it is).
    ops = [Prefill(0, 0, "a", 1), Preempt(1, 0), Abort(2, 0)]
    tiers = (TierSpec("host", 16),)
    trace = validate(Trace(Header("fuzz", tiers=tiers), ops, name="abort"))
    case = write_case(tmp_path, trace, make_config(1, 1, prefix_caching=True, max_context=2), "numpy")
    case["test_abort"]()  # passes: numpy has no bug here
    assert "tiers=(TierSpec(name='host', capacity=16, policy='lru', failed_load='keep'),)" in (tmp_path / "test_case_min.py").read_text()


def test_a_case_of_an_engine_skips_where_it_cannot_be_made(tmp_path, monkeypatch):
    trace = validate(Trace(Header("fuzz"), [Prefill(0, 0, "a", 3)], name="one"))
    config = make_config(2, 4)
    monkeypatch.setattr(registry.BackendEntry, "available", lambda self: (False, "vllm is not installed"))
    mark = write_case(tmp_path, trace, config, "vllm-kvmanager")["pytestmark"]
    assert (mark.name, mark.args, mark.kwargs) == ("skipif", (True,), {"reason": "vllm is not installed"})
    monkeypatch.setattr(registry.BackendEntry, "available", lambda self: (True, ""))
    assert write_case(tmp_path, trace, config, "vllm-kvmanager")["pytestmark"].args == (False,)
    # kvbench's own backends run everywhere: no mark that could hide a failure behind a skip
    assert "pytestmark" not in write_case(tmp_path, trace, config, "numpy")
