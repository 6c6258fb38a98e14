"""The SGLang adapters' ledgers come from a tally of the pages in the tables operations changed
(BlockTally, as the vLLM adapters'), not a read of every live request's table: after every
operation of the committed workloads, the tally's figures are those a read of every table gives.

Opt-in: needs SGLang (docs/engines.md); skipped elsewhere. Run::

    PYTHONPATH=$PWD /work/sglang-env/bin/python -m pytest tests/engines/test_sglang_tally.py
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvbench.analyses.suite import config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract import formulas as F

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"
# Shared prefixes, forks (a parent's checkpoint repoints its table), salts, evictions under
# pressure, refusals, preemption, decodes that fill a shared tail.
NAMES = ("prefix-reuse", "prefix-tenants", "prefix-salts", "fork-wide", "fork-beam",
         "fork-parallel", "edge-refusals", "edge-decode", "lifecycle-preempt", "tenant-late")


def scanned(be) -> dict:
    """The figures from every live request's table (its KV slots, one page per ``P`` of them)."""
    P = be.page
    fill, holders, reservation = {}, {}, 0
    for r in be.reqs.values():
        n = len(r.kv)
        for i, slot in enumerate(r.kv[::P].tolist()):
            fill[slot // P] = min(P, n - i * P)
            holders[slot // P] = holders.get(slot // P, 0) + 1
    for r in be.reqs.values():
        n = len(r.kv)
        if n % P and holders[int(r.kv[(n - 1) // P * P]) // P] == 1:  # a tail no other holds
            reservation += F.tail_reservation(P - n % P, r.final - n)
    return {"blocks_used": len(fill), "shared_blocks": sum(1 for h in holders.values() if h > 1),
            "token_states": sum(fill.values()), "reservation": reservation}


def scanning(cls):
    """The adapter, its every ledger checked against the scan."""

    class Scanned(cls):
        def ledger(self, seqs=None):
            led = super().ledger(seqs)
            want = scanned(self)
            assert {k: getattr(led, k) for k in want} == want
            return led

    return Scanned


def held_to_the_scan(trace, cls, cfg):
    """The checker's verdict on ``cls`` with its every ledger held to the scan, which must be
    its verdict without (a divergence both share is the engine's, not the tally's)."""
    v = check(trace, scanning(cls)(cfg))
    plain = check(trace, cls(cfg))
    assert (v.valid, str(v.divergence)) == (plain.valid, str(plain.divergence)), v.error or v.traceback
    assert not v.error, v.traceback
    assert v.ops == len(trace.ops) or not v.valid
    return v


@pytest.mark.parametrize("caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("adapter", ["Sglang", "SglangRadix"])
def test_the_tally_is_the_scan(sglang, name, adapter, caching):
    import impls.engines.sglang_radix as adapters
    trace = load_traces([WORKLOADS / f"{name}.jsonl"])[0]
    v = held_to_the_scan(trace, getattr(adapters, adapter),
                         config_for(trace, policy=None, prefix_caching=caching))
    if v.not_applicable:
        pytest.skip(v.not_applicable)


def test_a_locked_eviction_is_counted_as_the_scan_counts_it(sglang):
    """The planted fault that evicts locked nodes frees pages running requests still list, and
    the pool hands them out again (fork-wide FAILs at an append, tests/engines/
    test_engine_faults.py): a page then sits in two tables, one of them an operation did not
    name. The tally counts it as the scan does up to the divergence."""
    from impls.engines.faults_engines import SglangEvictsLocked
    trace = load_traces([WORKLOADS / "fork-wide.jsonl"])[0]
    v = held_to_the_scan(trace, SglangEvictsLocked, config_for(trace, policy=None, prefix_caching=True))
    assert v.valid is False
