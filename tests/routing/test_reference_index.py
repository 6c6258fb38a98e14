"""The reference index over KV events (SPEC §14): keys as the engine takes them, the longest cached
prefix per replica with SPEC §8's hybrid hit over a sliding group's sparse entries, the order rules,
and the planted indexes' bugs, each on events written by hand."""
from __future__ import annotations

import pytest

from kvbench.contract import formulas as F
from kvbench.contract.events import CLEARED, REMOVED, STORED, EventOrderError, KVEvent
from kvbench.contract.protocol import CacheConfig
from kvbench.model.oracle import Oracle
from kvbench.routing.index import (MissesCleared, ReferenceIndex, SparseAsPrefix, engine_keys,
                                   keys_own_block_size, keys_without_salt)

FULL = F.get_model("tiny").kv_groups  # one full group
HYBRID = F.with_group_kinds(F.get_model("tiny"), ["sliding(32)", "full"]).kv_groups


def stored(keys, group=0):
    return [KVEvent(STORED, k, keys[i - 1] if i else None, group) for i, k in enumerate(keys)]


@pytest.mark.parametrize("salt, adapter", [(None, None), ("t1", None), (None, "lora"), ("t1", "lora")])
def test_engine_keys_are_the_oracles_prompt_keys(salt, adapter):
    oracle = Oracle(CacheConfig(block_size=4, num_blocks=8, prefix_caching=True))
    hashes = (11, 12, 13)
    # 10 tokens: 10 // 4 = 2 full blocks, so two keys
    assert engine_keys(hashes, 10, 4, salt, adapter) == oracle.prompt_keys(10, hashes, salt=salt,
                                                                           adapter=adapter)
    assert len(engine_keys(hashes, 10, 4, salt, adapter)) == 2


def test_a_full_group_answers_the_longest_run_of_present_keys_per_replica():
    index = ReferenceIndex(2, FULL, 16)
    index.extend(0, stored([1, 2, 3]))
    index.extend(1, stored([1, 5]))
    assert index.overlaps((1, 2, 3, 4)) == [3, 1]  # replica 0: 1, 2, 3; replica 1: 1 (5 differs)
    index.apply(0, KVEvent(REMOVED, 3))
    assert index.overlaps((1, 2, 3, 4)) == [2, 1]


def test_a_sliding_groups_sparse_entries_give_the_hybrid_hit_and_the_contiguous_reading_does_not():
    # W = 32, B = 16: at L blocks the sliding group needs the blocks covering [16L - 31, 16L),
    # that is blocks L - 2 and L - 1. Full group: k0..k7; sliding group: k0..k7 but k6.
    keys = tuple(range(8))
    reference, faulty = ReferenceIndex(1, HYBRID, 16), SparseAsPrefix(1, HYBRID, 16)
    for index in (reference, faulty):
        index.extend(0, stored(keys, group=1))  # group 1 is the full one
        index.extend(0, stored(keys, group=0))
        index.apply(0, KVEvent(REMOVED, 6, None, 0))
    # L = 8 needs 6, 7 (6 gone); L = 7 needs 5, 6 (6 gone); L = 6 needs 4, 5: the hit is 6 blocks
    assert reference.overlap(0, keys) == 6
    # llm-d-router 2362: block 7 present vouches for 0..6, so all 8 blocks
    assert faulty.overlap(0, keys) == 8


def test_the_reference_holds_the_order_rules():
    index = ReferenceIndex(1, FULL, 16)
    with pytest.raises(EventOrderError, match="not present"):
        index.apply(0, KVEvent(REMOVED, 9))
    index.extend(0, stored([1]))
    with pytest.raises(EventOrderError, match="already present"):
        index.apply(0, KVEvent(STORED, 1))


def test_an_index_that_misses_cleared_believes_in_the_blocks_of_before():
    reference, faulty = ReferenceIndex(1, FULL, 16), MissesCleared(1, FULL, 16)
    for index in (reference, faulty):
        index.extend(0, stored([1, 2]))
        index.apply(0, KVEvent(CLEARED))
        index.extend(0, stored([1]))  # the replica stores block 1 again after its reset
    assert reference.overlap(0, (1, 2)) == 1
    assert faulty.overlap(0, (1, 2)) == 2


def test_the_planted_key_functions_differ_from_the_engines():
    hashes = (11, 12, 13, 14)
    assert keys_without_salt(hashes, 64, 16, "t1") == engine_keys(hashes, 64, 16) != \
        engine_keys(hashes, 64, 16, "t1")
    own = keys_own_block_size(hashes, 64, 16)
    assert len(own) == 2  # 64 // (2 * 16) = 2 blocks of its own size
    assert not set(own) & set(engine_keys(hashes, 64, 16))
