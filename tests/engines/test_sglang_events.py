"""SGLang's KV events (SPEC §14) through the radix adapters' ``events()``: SGLang's own
``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (``take_events``), replayed by the checker
against the oracle's radix tree (the sglang rule set's ``events_from_tree``: SGLang announces
a page when a checkpoint's insert makes its node and when an eviction takes its leaf).

Opt-in like every SGLang test (skipped with the reason where SGLang is not installed).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from conftest import make_config

from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract.events import CLEARED, REMOVED, STORED
from kvbench.contract.protocol import Prompt
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"
ONE_GROUP = [p for p in committed_workloads()
             if p.stem in ("prefix-reuse", "prefix-salts", "prefix-tenants", "fork-parallel", "edge-eviction")]


@pytest.mark.parametrize("tree", ["Sglang", "SglangRadix"])
@pytest.mark.parametrize("path", ONE_GROUP, ids=lambda p: p.stem)
def test_the_events_replay_the_tree_on_the_committed_workloads(sglang, path, tree):
    """The serving tree (Rust core) and RadixCache: every operation's events checked (the verdict
    counts them), none skipped. The other committed workloads run in test_sglang_radix.py's
    every-workload tests, with the events checked as well."""
    import impls.engines.sglang_radix as adapters
    trace = load_traces([path])[0]
    v = check(trace, getattr(adapters, tree)(config_for(trace, policy=None, prefix_caching=True)))
    assert v.valid is True, str(v.divergence)
    assert "events" not in v.skipped and v.events > 0


def test_a_node_is_stored_page_by_page_chained_and_removed_whole(sglang):
    """Page size 16: 40 tokens under hashes a, b make one node of 2 pages (the tail's 8 tokens
    are no page of the tree): 2 stored, the second's parent the first. Its eviction (a prompt of
    8 pages; 8 - 2 = 6 free once the tail is given back, the node's 2 the rest) removes both."""
    from impls.engines.sglang_radix import SglangRadix
    be = SglangRadix(make_config(16, 8, store_kv=False, prefix_caching=True))
    be.prefill(0, Prompt(40, block_hashes=["a", "b"]))
    # The tree's reset when it is built announces AllBlocksCleared (radix_cache.py:343-362).
    (cleared, first, second) = be.events()
    assert cleared.kind == CLEARED
    assert (first.kind, first.parent, second.kind, second.parent) == (STORED, None, STORED, first.key)
    be.free(0)
    assert be.events() == []  # the unlock announces nothing: the pages stay in the cache
    be.prefill(1, Prompt(8 * 16))
    removed = [e for e in be.events() if e.kind == REMOVED]
    assert {e.key for e in removed} == {first.key, second.key}


def test_held_to_the_caches_timing_a_decoded_page_is_announced_late(sglang):
    """events_from_tree: a page a decode fills is in the oracle's cache at once
    (caches_every_full_block), in SGLang's tree, and its events, only at the checkpoint of the
    request's free. Held to the cache's timing, step 1 (8 + 8 = 16 tokens: one full page)
    expects one stored the backend does not send."""
    from impls.engines.sglang_radix import SglangRadix
    trace = validate(Trace(Header(family="test", settings={"block_size": 16}),
                           [Prefill(0, 0, "a", 8, ()), Append(1, (0,), (8,)), Free(2, 0)], name="hand"))
    config = make_config(16, 4, store_kv=False, prefix_caching=True)
    assert check(trace, SglangRadix(config)).valid is True
    be = SglangRadix(config)
    be.capabilities = dataclasses.replace(
        be.capabilities, rule_params={**be.capabilities.rule_params, "events_from_tree": False})
    d = check(trace, be).divergence
    assert (d.index, d.quantity) == (1, "residency of group 0, tier 0"), str(d)
    assert len(d.expected["stored"]) == 1 and d.actual["stored"] == []


def test_a_split_whose_lower_node_keeps_the_whole_nodes_hashes_fails_at_prefix_tenants_step_17(sglang):
    """prefix-tenants (block size 8): step 1 inserts sequence 1's 6 prompt pages [p0.2, p0.3,
    r1.0, r1.1] below step 0's [p0.0, p0.1]; step 3's insert of [p0.0, p0.1, p0.2] splits that
    node after 1 page, its lower part [p0.3, r1.0, r1.1] keeping the 4 hashes it had. Step 15
    frees sequence 1 (its output leaf goes at step 16); step 17's allocation evicts the lower
    part, whose BlockRemoved names its first 3 stale hashes: p0.2 (still cached), p0.3, r1.0,
    where the tree lost p0.3, r1.0, r1.1. The index now believes in p0.2's page being gone and
    in r1.1's being there."""
    from impls.engines.faults_engines import SglangRadixSplitStaleHashes
    trace = load_traces([WORKLOADS / "prefix-tenants.jsonl"])[0]
    v = check(trace, SglangRadixSplitStaleHashes(config_for(trace, policy=None, prefix_caching=True)))
    d = v.divergence
    assert (d.index, d.quantity) == (17, "residency of group 0, tier 0"), str(d)
    assert d.expected["removed"] == ["p0.3", "r1.0", "r1.1"]
    assert d.actual["removed"] == ["p0.2", "p0.3", "r1.0"]
