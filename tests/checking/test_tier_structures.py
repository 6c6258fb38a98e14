"""SPEC §10's block structures during tier replays (SPEC §11): each store in flight is one
reference more on the blocks it copies, beside the tables' references, and a load's targets are
their sequence's alone. Every tiered pool passes the committed tier workloads with its structures
checked; a pool whose reported reference counts leave the leases out fails there, and only the
structures show it."""
from __future__ import annotations

import importlib.util

import pytest

from impls.faults_tiers import LeasesOutOfRefcounts
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract import registry

WORKLOADS = ("tier-agentic", "tier-turns", "lifecycle-swap")
POOLS = ["numpy", "numpy-int8", "numpy-int4", pytest.param("torch", marks=pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed"))]


@pytest.fixture(scope="module")
def traces():
    return suite.load_traces([suite.WORKLOADS_DIR / f"{w}.jsonl" for w in WORKLOADS])


@pytest.mark.parametrize("name", POOLS)
def test_every_tiered_pool_passes_with_its_structures_checked(traces, name):
    for trace in traces:
        backend = registry.create(name, suite.config_for(trace))
        try:
            v = check(trace, backend)
        finally:
            backend.close()
        assert v.valid is True, f"{trace.name}: {v.divergence}"
        assert "block structures" not in v.skipped, v.skipped["block structures"]


def test_leases_left_out_of_the_counts_fail_at_the_first_store(traces):
    # tier-agentic, blocks of 8: step 0 prefills the shared prefix, 49 tokens in blocks 0 .. 6
    # (ceil(49 / 8) = 7), the first 6 hashed; step 1 stores them to disk: block 0 is held by
    # one table and leased by one store, 1 + 1 references, reported without the lease.
    v = check(traces[0], LeasesOutOfRefcounts(suite.config_for(traces[0])))
    d = v.divergence
    assert v.valid is False
    assert (d.trace, d.step, d.quantity, d.expected, d.actual) == (
        "tier-agentic", 1, "reference count of block 0", 1 + 1, 1)
    assert "1 for the store(s) in flight copying it" in d.detail


class HidesItsStructures(LeasesOutOfRefcounts):
    def block_state(self, seqs=None, *, changed_since=None):
        raise NotImplementedError


def test_only_the_structures_show_leases_left_out_of_the_counts(traces):
    # The same pool without block_state(): its ledger, tiers and K/V are right on every workload.
    for trace in traces:
        v = check(trace, HidesItsStructures(suite.config_for(trace)))
        assert v.valid is True, f"{trace.name}: {v.divergence}"
        assert "block structures" in v.skipped


@pytest.mark.parametrize("name", POOLS)
def test_a_load_s_computed_blocks_count_in_its_table_from_the_begin(name):
    """`kvbench fuzz --backend numpy` found it (seed 0, history 9, shrunk 39 -> 4): a load whose
    prompt names no stored block computes its one block at the begin; the structures compared
    the pool's reference to that block (1: the loading sequence's table) with a stale mirror of
    the tables that lacked it (0)."""
    from kvbench.traces.format import loads
    trace = loads("\n".join([
        '{"kvbench_trace": 1, "family": "test", "generator": "tests", "params": {}, "seed": 0, '
        '"settings": {"model": "tiny", "block_size": 2, "num_blocks": 6, "prefix_caching": true}, '
        '"tiers": [{"name": "host", "capacity": 1, "policy": "lru"}]}',
        '{"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 1}',
        '{"step": 1, "op": "prefill", "seq": 1, "tenant": "a", "tokens": 7}',
        '{"step": 2, "op": "load", "seq": 2, "tenant": "a", "tokens": 1, "block_hashes": [], "id": 2}',
        '{"step": 3, "op": "free", "seq": 0}']))
    backend = registry.create(name, suite.config_for(trace, policy=None))
    try:
        v = check(trace, backend)
    finally:
        backend.close()
    assert v.valid is True, v.divergence
    assert "block structures" not in v.skipped
