"""The oracle's radix tree as an engine's block structures and KV events show it, without SGLang:
its cached blocks in eviction order (what an engine under ``evicts_whole_leaves`` is held to) and
the events it expects under ``events_from_tree``. tests/engines/test_sglang_block_state.py and
test_sglang_events.py hold SGLang itself to them."""
from __future__ import annotations

import dataclasses

from kvbench.contract.protocol import CacheConfig, Capabilities
from kvbench.model.events import ExpectedEvents
from kvbench.model.oracle import Oracle
from kvbench.model.rules.sglang import RadixTree

NEVER = lambda keys: False  # noqa: E731  (nothing locked)


def sglang_oracle(block_size: int, num_blocks: int, **rules) -> Oracle:
    config = CacheConfig(block_size=block_size, num_blocks=num_blocks, prefix_caching=True,
                         store_kv=False)
    return Oracle(config, capabilities=Capabilities(prefix_caching=True, rules="sglang",
                                                    rule_params=rules))


def test_the_eviction_order_is_what_evicting_everything_takes_and_leaves_the_tree():
    t = RadixTree("lru")
    t.insert(["a", "b", "c"])
    t.insert(["x"])
    assert t.match(["a", "q"]) == 1  # [a] above [b c]
    # The match touched [a b c] before splitting it: the lower leaf [b c] keeps that time, after
    # x's insert, so the leaf [x] goes first, then [b c], then [a], childless (made by the split).
    order = t.eviction_order(NEVER)
    assert order == ["x", "b", "c", "a"]
    assert t.evict(4, NEVER) == order  # the same as an eviction of everything
    assert t.eviction_order(NEVER) == []


def test_a_locked_leaf_keeps_its_parent_out_of_the_order():
    t = RadixTree("lru")
    t.insert(["a", "b"])
    t.match(["a", "q"])  # [a] above [b]
    t.insert(["a", "c"])  # [c] beside [b]
    assert t.eviction_order(lambda keys: keys == ["b"]) == ["c"]  # [a] keeps its locked child


def test_the_oracle_lists_its_cached_blocks_in_the_trees_order():
    """B = 4: "p" (block 0) then "q" (block 1) cached as two leaves; a later prompt starting
    with "p" hits it (and touches it), so lru takes "q" first."""
    o = sglang_oracle(4, 8)
    o.prefill(0, 4, "a", 4, 0, hashes=("p",))
    o.free(0)
    o.prefill(1, 4, "a", 4, 1, hashes=("q",))
    o.free(1)
    assert o.block_state().cached == [0, 1]  # released in this order, touched in this order
    o.prefill(2, 5, "a", 5, 2, hashes=("p",))  # hits "p" (4 = (5 - 1) // 4 * 4 tokens)
    o.free(2)
    assert o.block_state().cached == [1, 0]  # "q" untouched since: first


def test_events_from_tree_announce_a_decoded_block_at_the_free():
    """B = 4: 2 tokens, then 2 appended fill block 0, which the oracle caches at the append
    (caches_every_full_block); SGLang's tree gets it at the free's checkpoint, and so do the
    expected events. Without the rule they follow the cache: stored at the append."""
    for rule, at in ((True, "free"), (False, "append")):
        o = sglang_oracle(4, 4, events_from_tree=rule)
        expected = ExpectedEvents(o)
        o.prefill(0, 2, "a", 4, 0)
        assert expected.changes() == {}
        o.append([0], [2], 1)
        appended = expected.changes()
        o.free(0)
        freed = expected.changes()
        stored = freed if at == "free" else appended
        (keys, removed), = stored.values()
        assert len(keys) == 1 and not removed
        assert (appended if at == "free" else freed) == {}
