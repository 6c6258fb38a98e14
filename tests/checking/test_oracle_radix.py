"""The oracle's model of SGLang's declared prefix-cache rules (kvbench/model/rules/sglang.py and
Oracle's radix hooks), without SGLang: each rule gives the hand-counted figures, and SPEC's rule
the others. The same traces run against SGLang itself in tests/engines/test_sglang_radix.py."""
from __future__ import annotations

import dataclasses

import pytest

from kvbench.model.oracle import ModelOOM, Oracle
from kvbench.model.rules.sglang import RadixTree
from kvbench.contract.protocol import CacheConfig, Capabilities

SGLANG_RULES = Capabilities(prefix_caching=True, rules="sglang")


def oracle(block_size: int, num_blocks: int, **spec_rules) -> Oracle:
    """An oracle holding a backend to SGLang's rules, but ``spec_rules`` put back to SPEC's."""
    config = CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=True,
                         store_kv=False)
    return Oracle(config, capabilities=dataclasses.replace(SGLANG_RULES, rule_params=spec_rules))


def cached(o: Oracle) -> int:
    return o.expected_ledger().cached_blocks


def test_the_tree_splits_where_a_match_ends_and_evicts_whole_leaves():
    t = RadixTree("lru")
    t.insert(["a", "b", "c"])
    assert t.match(["a", "x"]) == 1  # splits [a b c] into [a] -> [b c]
    never = lambda keys: False  # noqa: E731
    assert t.evict(1, never) == ["b", "c"]  # 1 block asked, the leaf of 2 goes whole
    assert t.evict(1, never) == ["a"]  # its parent, childless now
    assert t.evict(1, never) == []


@pytest.mark.parametrize("order, first", [("lru", "y"), ("mru", "x"), ("fifo", "x"), ("lfu", "y")])
def test_the_leaf_order_is_the_policy(order, first):
    t = RadixTree(order)
    t.insert(["x"])
    t.insert(["y"])
    t.match(["x"])  # x: created first, touched last
    t.insert(["x"], inserted=0)  # and found again: hit count 2 against y's 1
    assert t.evict(1, lambda keys: False) == [first]


@pytest.mark.parametrize("rule", [{}, {"eviction_demand": "need"}])
def test_page_per_request(rule):
    """B = 16, 2 pages: "p" cached, 1 free; an 8-token prompt needs the free page. SGLang evicts
    for 8 + 16 = 24 tokens against 16 free: "p" goes (cached 0); SPEC's need keeps it (1)."""
    o = oracle(16, 2, **rule)
    o.prefill(0, 16, "a", 16, 0, hashes=("p",))
    o.free(0)
    o.prefill(1, 8, "a", 8, 2)
    assert cached(o) == (1 if rule else 0)  # 1 - 1 under the rule


@pytest.mark.parametrize("rule", [{}, {"evicts_whole_leaves": False}])
def test_whole_leaves(rule):
    """B = 1, 4 pages: a node of 3 cached tokens; a 2-token prompt finds 1 free, so 1 must go:
    the whole node (cached 0), or SPEC's one block (cached 3 - 1 = 2)."""
    o = oracle(1, 4, **rule)
    o.prefill(0, 3, "a", 3, 0)
    o.free(0)
    o.prefill(1, 2, "a", 2, 2)
    assert cached(o) == (3 - 1 if rule else 0)


@pytest.mark.parametrize("rule", [{}, {"evicts_whole_leaves": False}])
def test_lru_order_counts_a_refused_match(rule):
    """B = 1, 4 pages: "a" then "b" released, 2 pages live; a refused prompt starting with "a"
    touches it (the tree's match), so the next page evicts "b" and the last prompt hits "a" (1);
    SPEC's first-released order evicts "a" (0 hits)."""
    o = oracle(1, 4, **rule)
    o.prefill(0, 1, "a", 1, 0, hashes=("a",))
    o.free(0)
    o.prefill(1, 1, "a", 1, 2, hashes=("b",))
    o.free(1)
    o.prefill(2, 2, "a", 2, 4)
    with pytest.raises(ModelOOM):  # 6 - 1 hit = 5 pages, 1 evictable ("b"; "a" is its hit)
        o.prefill(3, 6, "a", 6, 5, hashes=("a", "x1", "x2", "x3", "x4", "x5"))
    o.prefill(4, 1, "a", 1, 6)
    o.free(4)
    o.prefill(5, 2, "a", 2, 8, hashes=("a", "z"))
    assert o.expected_ledger().prefix_hit_blocks == (0 if rule else 1)


@pytest.mark.parametrize("rule", [{}, {"capped_hit_recomputed": False}])
def test_capped_hit_recomputed(rule):
    """B = 1, 3 pages all cached ("a b" and "c"): a prompt "a b" hits (2 - 1) // 1 = 1 and
    computes "b" again into a page evicted for ("c", the least recently touched), then shares
    the tree's "b": cached 0. SPEC takes both cached pages and keeps "c": cached 1."""
    o = oracle(1, 3, **rule)
    o.prefill(0, 2, "a", 2, 0, hashes=("a", "b"))
    o.free(0)
    o.prefill(2, 1, "a", 1, 2, hashes=("c",))
    o.free(2)
    o.prefill(1, 2, "a", 2, 4, hashes=("a", "b"))
    assert (cached(o), o.expected_ledger().blocks_used) == ((1 if rule else 0), 2)


@pytest.mark.parametrize("rule", [{}, {"capped_hit_recomputed": False}])
def test_a_fork_needs_a_page_for_its_capped_block(rule):
    """B = 1, 6 pages, a 6-token parent holds them all: its fork hits 6 - 1 = 5 and needs 1
    page (refused); SPEC's fork shares all 6 and needs none."""
    o = oracle(1, 6, **rule)
    o.prefill(0, 6, "a", 6, 0)
    if rule:
        o.fork(1, 0, 6, 1)
        assert o.expected_ledger().blocks_used == 6
    else:
        with pytest.raises(ModelOOM):
            o.fork(1, 0, 6, 1)


def test_a_resumed_sequence_caches_its_blocks_anew():
    """B = 1, 4 pages: 1 unhashed token, preempted (its block cached), recomputed into a new
    block (new content to the cache), freed: 2 cached."""
    o = oracle(1, 4)
    o.prefill(0, 1, "a", 1, 0)
    o.preempt(0)
    o.recompute(0, 2)
    o.free(0)
    assert cached(o) == 2
