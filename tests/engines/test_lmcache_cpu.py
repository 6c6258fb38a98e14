"""LMCache's CPU storage backend (``LocalCPUBackend``) as the lower tiers of the NumPy pool, under
the checker (impls/engines/lmcache_cpu.py).

LMCache is opt-in (docs/tiers-and-lifecycles.md's recipe builds /work/lmcache-env); CI does not
install it, so every test that needs it is skipped there with the reason. Run them from the
repository root with::

    PYTHONPATH=$PWD /work/lmcache-env/bin/python -m pytest tests/engines/test_lmcache_cpu.py
"""
from __future__ import annotations

import pytest
from conftest import make_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_tier_properties import histories
from test_vllm_offload import checked

from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract.registry import entries
from kvbench.traces.format import Free, Header, Prefill, Trace, validate
from kvbench.traces.tier_ops import Done, Store, TierSpec

SKIP_REASON = "LMCache is not installed (opt-in, not in CI): see docs/tiers-and-lifecycles.md"
B = 4
TIER_WORKLOADS = [p for p in committed_workloads() if load_traces([p])[0].header.tiers]


@pytest.fixture(scope="module")
def lmcache():
    return pytest.importorskip("lmcache", reason=SKIP_REASON)


def adapter(num_blocks=8):
    from impls.engines.lmcache_cpu import LMCacheCPU
    return LMCacheCPU(make_config(block_size=B, num_blocks=num_blocks, prefix_caching=True))


def test_registered_as_an_engine():
    entry = entries()["lmcache-cpu"]
    assert "engine" in entry.tags and entry.target == "impls.engines.lmcache_cpu:LMCacheCPU"


@pytest.mark.parametrize("path", TIER_WORKLOADS, ids=lambda p: p.stem)
def test_passes_the_tier_workloads(lmcache, path):
    from impls.engines.lmcache_cpu import LMCacheCPU
    trace = load_traces([path])[0]
    v = checked(trace, LMCacheCPU(config_for(trace)), gather="all")
    if any(op.kind == "preempt" and op.mode == "swap" for op in trace.ops):  # SPEC §13 over §11
        assert v.valid is None and "does not preempt by swap" in v.not_applicable, v.not_applicable
        return
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)
    assert "block structures" not in v.skipped  # its leases counted (SPEC §10 during §11)
    assert "GPU connector" in v.skipped["tier copies"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.integers(4, 6).flatmap(lambda n: st.tuples(st.just(n), histories(n))),
       host=st.integers(0, 3))
def test_passes_random_histories(lmcache, case, host):
    blocks, ops = case
    tiers = (TierSpec("host", host), TierSpec("disk", 4))
    trace = validate(Trace(Header("random", tiers=tiers), ops, name="random"))
    v = checked(trace, adapter(blocks), gather="all")
    assert v.valid is True, (v.divergence, v.error)


def test_a_failed_store_leaves_no_trace_in_lmcache(lmcache):
    # 2 full blocks stored to a host tier of 4 pages; the store fails: LMCache's hot cache finds
    # neither, and both pages are back in its allocator (4 free of 4).
    ops = [Prefill(0, 0, "a", 2 * B, (1, 2)), Store(1, 1, 0, "host"), Done(2, 1, False)]
    trace = validate(Trace(Header("failed", tiers=(TierSpec("host", 4),)), ops, name="failed"))
    backend = adapter()
    try:
        assert check(trace, backend).valid is True
        tier = backend._tiers[0]
        assert len(tier.backend.hot_cache) == 0 and len(tier.allocator.free_blocks) == 4
        assert not any(tier.loadable(k, 1) for k in ((0, 1), (0, 2)))
    finally:
        backend.close()


def test_a_store_evicts_its_own_stored_block_as_lmcache_declares(lmcache):
    # Found by test_passes_random_histories, cut down by hand. A host tier of 1 page holds block
    # key 1; sequence 1's store offers keys 1 and 2: 1 is skipped (stored), and LMCache's
    # allocate for 2 evicts 1 by its LRU, the store's own block or not. The adapter declares it
    # (store_evicts_skipped): after the store, 1 stored + 0 storing + 0 free = 1 page, block 2.
    ops = [Prefill(0, 0, "t", B, (1,)), Store(1, 0, 0, "host"), Done(2, 0, True),
           Free(3, 0), Prefill(4, 1, "t", 2 * B, (1, 2)), Store(5, 1, 1, "host"),
           Done(6, 1, True)]
    trace = validate(Trace(Header("own-evicted", tiers=(TierSpec("host", 1),)), ops,
                           name="own-evicted"))
    backend = adapter()
    try:
        assert "store_evicts_skipped" in backend.capabilities.tier_rules
        v = check(trace, backend, gather="all")
        assert v.valid is True, str(v.divergence)
        assert v.ops == len(ops)
    finally:
        backend.close()
