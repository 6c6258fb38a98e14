"""The oracle against closed forms (SPEC §2, §3, §5)."""
from __future__ import annotations

import copy

import pytest
from conftest import TINY, make_config

from kvbench.contract import formulas as F
from kvbench.contract.protocol import Capabilities
from kvbench.model.oracle import ModelOOM, Oracle, step

B = 16
BLOCK_BYTES = B * TINY.bytes_per_token  # 16 * 128 = 2048


def paged(num_blocks=64, **kw) -> Oracle:
    return Oracle(make_config(B, num_blocks, **kw), layout="paged")


def snapshot(o: Oracle):
    return copy.deepcopy((o.seqs, o.blocks, o.preempted, o.free_stack, o.fresh, o.evictable))


# --- capacity without sharing -------------------------------------------------------------

def test_no_sharing_blocks_are_the_sum_of_ceils():
    o = paged()
    o.prefill(0, 20, "a", 48, step=0)
    o.prefill(1, 16, "a", 17, step=1)
    o.prefill(2, 1, "a", 41, step=2)
    assert o.blocks_used == 2 + 1 + 1  # ceil(20/16) + ceil(16/16) + ceil(1/16)
    o.append([0, 1, 2], [13, 1, 40], step=3)
    o.append([0], [15], step=4)
    lengths = {0: 48, 1: 17, 2: 41}  # 20+13+15, 16+1, 1+40
    assert o.blocks_used == 3 + 2 + 3 == sum(F.blocks_needed(t, B) for t in lengths.values())
    led = o.expected_ledger()
    assert led.tokens == lengths
    assert led.seq_blocks == {0: 3, 1: 2, 2: 3}
    assert led.capacity_slots == 8 * 16
    assert led.free_slots == 128 - 106  # 106 = 48 + 17 + 41 tokens held
    assert led.fragmentation == 22 / 128
    assert led.bytes_in_use == 8 * BLOCK_BYTES
    assert led.blocks_free == 64 - 8 and led.free == 56 * 16
    assert led.shared_blocks == 0
    # Every sequence has reached its final length: nothing is reserved for later tokens.
    assert led.reservation == 0 and led.internal_fragmentation == 22
    o.free(0)
    assert o.blocks_used == 5  # free returns all 3 blocks of sequence 0


def test_reservation_is_the_private_tail_slots_later_tokens_will_use():
    o = paged()
    o.prefill(0, 20, "a", 100, step=0)  # tail holds 4 of 16; 80 tokens still to come
    o.prefill(1, 20, "a", 22, step=1)   # 2 tokens still to come
    led = o.expected_ledger()
    assert led.reservation == 12 + 2  # min(16 - 4, 80) + min(16 - 4, 2)
    assert led.internal_fragmentation == 24 - 14  # free slots 12 + 12, minus the reservation
    assert led.token_states == 40
    # The five categories add up to the whole budget: 64 blocks of 16 slots.
    assert (led.token_states + led.reservation + led.internal_fragmentation
            + led.external_fragmentation + led.free) == 64 * 16


# --- sharing ------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("batched", [False, True])
def test_k_way_fork_copies_only_the_partial_tail(k, batched):
    prefix = 40  # 2 whole blocks + a tail of 8
    o = paged()
    o.prefill(0, prefix, "a", prefix + 1, step=0)
    for child in range(1, k):
        o.fork(child, 0, prefix + 1, step=child)
    assert o.blocks_used == 3  # ceil(40/16): the fork copies only block tables
    assert o.expected_ledger().shared_blocks == 3
    if batched:
        o.append(list(range(k)), [1] * k, step=k)
    else:
        for s in range(k):
            o.append([s], [1], step=k + s)
    # Every branch but one copies the shared tail: ceil(T_p / B) + (k - 1).
    assert o.blocks_used == F.blocks_needed(prefix, B) + (k - 1)
    shared_bytes = o.expected_ledger().bytes_in_use
    unshared_bytes = k * F.blocks_needed(prefix + 1, B) * BLOCK_BYTES  # each branch alone: 3 blocks
    assert unshared_bytes - shared_bytes == F.sharing_saving(prefix, k, TINY, B) == (k - 1) * 32 * 128
    assert o.expected_ledger().shared_blocks == 2  # the 2 whole prefix blocks stay shared


def test_fork_branches_that_spill_take_new_blocks_and_save_the_same():
    k, prefix = 3, 40
    o = paged()
    o.prefill(0, prefix, "a", 60, step=0)
    o.fork(1, 0, 60, step=1)
    o.fork(2, 0, 60, step=2)
    o.append([0, 1, 2], [20, 20, 20], step=3)
    # Per branch: 8 tokens fill the tail (its copy), 12 spill into ceil(12/16) = 1 new block.
    assert o.blocks_used == 3 + (k - 1) + k * 1
    unshared = k * F.blocks_needed(60, B)  # 3 * 4 = 12 blocks
    assert (unshared - o.blocks_used) * BLOCK_BYTES == F.sharing_saving(prefix, k, TINY, B)


def test_fragmentation_counts_a_shared_block_once():
    o = paged()
    o.prefill(0, 40, "a", 40, step=0)   # blocks 16, 16, 8
    o.fork(1, 0, 40, step=1)            # shares all three
    o.prefill(2, 20, "a", 20, step=2)   # blocks 16, 4
    led = o.expected_ledger()
    assert led.blocks_used == 5
    assert led.capacity_slots == 5 * 16
    assert led.free_slots == 8 + 12  # the shared tail's 8 free slots once, plus 12
    assert led.fragmentation == 20 / 80  # counting the shared blocks twice would give 28/128
    assert led.token_states == 60  # 40 shared tokens held once + 20


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [1, 2, 0]])
def test_copy_on_write_in_one_batch_copies_for_all_but_the_last_writer(order):
    o = paged()
    o.prefill(0, 40, "a", 41, step=0)
    o.fork(1, 0, 41, step=1)
    o.fork(2, 0, 41, step=2)
    tail = o.seqs[0].table[-1]
    whole = o.seqs[0].table[:2]
    o.append(order, [1, 1, 1], step=3)
    # Reference count 3: the first writer copies (3 -> 2), the second copies (2 -> 1),
    # the last is the only owner left and writes in place.
    first, second, last = order
    assert o.seqs[last].table[-1] == tail
    copies = {o.seqs[first].table[-1], o.seqs[second].table[-1]}
    assert len(copies) == 2 and tail not in copies
    for s in order:
        assert o.seqs[s].table[:2] == whole  # full blocks stay shared
        assert o.blocks[o.seqs[s].table[-1]] == [1, 9]  # private, 8 copied + 1 written
    assert o.blocks_used == 5


def test_a_full_shared_tail_is_not_copied():
    o = paged()
    o.prefill(0, 32, "a", 33, step=0)
    o.fork(1, 0, 33, step=1)
    o.append([0, 1], [1, 1], step=2)
    assert o.blocks_used == 2 + 2  # no copy: each writer takes one new block
    assert o.expected_ledger().shared_blocks == 2


# --- out of memory ------------------------------------------------------------------------

def test_out_of_memory_changes_nothing():
    o = paged(num_blocks=4)
    o.prefill(0, 16, "a", 32, step=0)
    o.prefill(1, 16, "a", 33, step=1)
    before, led = snapshot(o), o.expected_ledger()
    with pytest.raises(ModelOOM):
        o.prefill(2, 48, "a", 48, step=2)  # needs 3, 2 free
    # 16 + 17 tokens: 1 + 2 new blocks, 2 free. Sequence 0 alone would fit: it must not grow.
    with pytest.raises(ModelOOM):
        o.append([0, 1], [16, 17], step=3)
    assert snapshot(o) == before and o.expected_ledger() == led


def test_out_of_memory_counts_copy_on_write_copies():
    o = paged(num_blocks=4)
    o.prefill(0, 40, "a", 41, step=0)  # 3 blocks, 1 free
    o.fork(1, 0, 41, step=1)
    o.fork(2, 0, 41, step=2)
    before = snapshot(o)
    with pytest.raises(ModelOOM):  # two copies needed, one block free
        o.append([0, 1, 2], [1, 1, 1], step=3)
    assert snapshot(o) == before
    assert o.append([0], [1], step=4) == []  # one copy (references 3 -> 2) fits in the free block
    assert o.blocks_used == 4
    with pytest.raises(ModelOOM):  # 1 and 2 still share the tail: 1 must copy, nothing is free
        o.append([1], [1], step=5)


# --- eviction (SPEC §5) ----------------------------------------------------------------------


def test_lru_ties_break_on_the_smaller_sequence_id():
    o = paged(num_blocks=4, policy="lru")
    o.prefill(1, 16, "a", 32, step=0)
    o.prefill(0, 16, "a", 32, step=1)
    o.append([1, 0], [16, 16], step=2)  # both last accessed at step 2, 4 blocks in use
    # (2, 0) < (2, 1): sequence 0 goes; its 2 blocks are enough, so 1 stays.
    assert o.prefill(2, 16, "a", 16, step=3) == [0]
    assert set(o.seqs) == {1, 2}
    assert o.tenant_stats["a"].evictions == 1


def test_eviction_stops_as_soon_as_enough_is_free():
    o = paged(num_blocks=5, policy="lru")
    for s in range(5):
        o.prefill(s, 16, "a", 16, step=s)
    assert o.prefill(9, 48, "a", 48, step=5) == [0, 1, 2]  # 3 blocks needed: the 3 oldest
    assert set(o.seqs) == {3, 4, 9}


def test_no_eviction_while_enough_is_free():
    o = paged(num_blocks=5, policy="lru")
    o.prefill(0, 16, "a", 16, step=0)
    assert o.prefill(1, 64, "a", 64, step=1) == []  # 4 needed, 4 free


def test_lfu_orders_by_use_count_then_recency_then_id():
    o = paged(num_blocks=4, policy="lfu")
    for s in (1, 2, 3):
        o.prefill(s, 8, "a", 16, step=s - 1)   # steps 0, 1, 2; one half-full block each
    o.append([1, 2], [1, 1], step=3)
    o.append([1], [1], step=4)
    o.prefill(4, 8, "a", 8, step=5)
    # (use_count, last_access, id): 1 -> (3, 4), 2 -> (2, 3), 3 -> (1, 2), 4 -> (1, 5).
    # LRU would say 3, 2, 1, 4: LFU puts the fresh sequence 4 before the used ones.
    assert o.prefill(9, 64, "a", 64, step=6) == [3, 4, 2, 1]


def test_lfu_ties_on_recency_break_on_id():
    o = paged(num_blocks=2, policy="lfu")
    o.prefill(6, 8, "a", 9, step=0)
    o.prefill(5, 8, "a", 9, step=1)
    o.append([6, 5], [1, 1], step=2)  # both (2, 2)
    assert o.prefill(7, 8, "a", 8, step=3) == [5]


@pytest.mark.parametrize("policy, victims", [
    # LFU: the child (1 use, step 2) goes before its source (2 uses, step 1)
    ("lfu", [1, 0]),
    # LRU: the source (step 1) goes before the child (step 2)
    ("lru", [0, 1]),
])
def test_fork_sets_the_child_to_step_and_one_use_and_shared_blocks_survive_one_victim(policy, victims):
    o = paged(num_blocks=2, policy=policy)
    o.prefill(0, 8, "a", 9, step=0)
    o.append([0], [1], step=1)       # source: (last 1, uses 2)
    o.fork(1, 0, 9, step=2)          # child: (last 2, uses 1); source unchanged
    assert (o.seqs[0].last_access, o.seqs[0].use_count) == (1, 2)
    # 2 blocks needed, 1 free. The first victim only drops a reference to the shared block
    # (2 -> 1): nothing returns to the pool, so the second must go too.
    assert o.prefill(2, 32, "a", 32, step=3) == victims
    assert o.blocks_used == 2 and set(o.seqs) == {2}


def test_fair_quota_is_exact():
    # Weights 0.1 / 0.2 / 0.3 over 10 blocks: quota_c = 0.3 / 0.6 * 10 = 5 exactly,
    # quota_b = 0.2 / 0.6 * 10 = 10/3, quota_a = 0.1 / 0.6 * 10 = 5/3.
    o = paged(num_blocks=10, policy="fair", tenant_weights={"a": 0.1, "b": 0.2, "c": 0.3})
    o.prefill(0, 16, "a", 16, step=0)   # a: 1 block  < 5/3
    o.prefill(1, 48, "b", 48, step=1)   # b: 3 blocks < 10/3
    o.prefill(2, 80, "c", 80, step=2)   # c: 5 blocks, exactly at quota: NOT over
    # 2 blocks needed, 1 free. Nobody is over quota, so global LRU: sequence 0 (step 0).
    # (In float, 0.3 / (0.1 + 0.2 + 0.3) * 10 = 4.999999999999999 would put c "over".)
    assert o.prefill(3, 32, "b", 32, step=3) == [0]


def test_fair_takes_the_most_over_quota_tenant_first():
    # Weights a 1, b 3 over 8 blocks: quota_a = 2, quota_b = 6.
    o = paged(num_blocks=8, policy="fair", tenant_weights={"a": 1, "b": 3})
    o.prefill(0, 80, "b", 80, step=0)   # b: 5 blocks, under 6 (and the oldest)
    o.prefill(1, 32, "a", 32, step=1)   # a: 2 ...
    o.prefill(2, 16, "a", 16, step=2)   # ... + 1 = 3 blocks, over 2 by 1
    # a's least recently used sequence goes; its 2 blocks are enough.
    assert o.prefill(3, 16, "b", 16, step=3) == [1]


def test_fair_falls_back_to_lru_when_the_over_tenant_is_being_served():
    o = paged(num_blocks=4, policy="fair", tenant_weights={"a": 1, "b": 1})  # quotas 2 and 2
    o.prefill(0, 16, "b", 16, step=0)   # b: 1 block
    o.prefill(1, 48, "a", 49, step=1)   # a: 3 blocks, over 2; the only a sequence
    # a's only sequence is the one appending, so it cannot be evicted: b's LRU goes.
    assert o.append([1], [1], step=2) == [0]


def test_the_served_sequence_is_never_its_own_victim():
    o = paged(num_blocks=2, policy="lru")
    o.prefill(0, 16, "a", 17, step=0)
    o.prefill(1, 16, "a", 16, step=1)
    # 0 is the least recently used, but it is the one appending: 1 goes.
    assert o.append([0], [1], step=2) == [1]


def test_protected_sequences_are_not_victims_of_a_recompute():
    o = paged(num_blocks=2, policy="lru")
    o.prefill(0, 16, "a", 16, step=0)
    o.prefill(1, 16, "a", 16, step=1)
    assert o.prefill(2, 16, "a", 16, step=2, protect={0}) == [1]


def test_no_eviction_when_even_evicting_everything_cannot_make_room():
    o = paged(num_blocks=4, policy="lru")
    o.prefill(0, 32, "a", 80, step=0)
    o.prefill(1, 16, "a", 16, step=1)
    before = snapshot(o)
    with pytest.raises(ModelOOM):
        o.prefill(2, 80, "a", 80, step=2)  # 5 blocks > 4 in the whole pool
    with pytest.raises(ModelOOM):
        o.append([0], [48], step=3)  # 3 new blocks: 1 free + 1 from evicting 1 = 2 < 3
    assert snapshot(o) == before


def test_evicted_sequence_is_recomputed_with_its_content():
    o = paged(num_blocks=2, policy="lru")
    o.prefill(0, 10, "a", 12, step=0)
    o.append([0], [2], step=1)
    o.prefill(1, 32, "a", 32, step=2)  # evicts 0
    assert 0 in o.preempted and 0 not in o.seqs
    assert o.recompute(0, step=3) == [1]
    assert o.seqs[0].tokens == 12 and o.expected_content(0) == [(0, 0, 10), (0, 10, 2)]
    assert o.tenant_stats["a"].recomputed_tokens == 12


# --- the contiguous model -----------------------------------------------------------------

def contiguous(num_blocks=8, reservation="oracle", **kw) -> Oracle:
    return Oracle(make_config(B, num_blocks, reservation=reservation, **kw), layout="contiguous")


def test_first_fit_offsets_and_external_fragmentation():
    o = contiguous()  # 8 * 16 = 128 slots; `oracle` reserves exactly the final length
    o.prefill(0, 10, "a", 10, step=0)
    o.prefill(1, 20, "a", 20, step=1)
    o.prefill(2, 30, "a", 30, step=2)
    assert [o.seqs[s].slabs[0] for s in (0, 1, 2)] == [(0, 10), (10, 20), (30, 30)]
    o.free(1)                          # hole [10, 30)
    o.prefill(3, 15, "a", 15, step=3)  # first fit: the hole, at 10
    o.prefill(4, 6, "a", 6, step=4)    # [25, 30) holds only 5: after the last slab, at 60
    assert o.seqs[3].slabs[0] == (10, 15) and o.seqs[4].slabs[0] == (60, 6)
    led = o.expected_ledger()
    assert led.capacity_slots == 10 + 30 + 15 + 6
    assert led.external_fragmentation == 5      # the hole [25, 30), below the last end 66
    assert led.free == 128 - 66
    o.prefill(5, 5, "a", 5, step=5)    # fits [25, 30) exactly
    assert o.seqs[5].slabs[0] == (25, 5)
    o.free(0)                          # hole [0, 10)
    assert o.expected_ledger().external_fragmentation == 10
    assert o.blocks_used == 0          # the contiguous model has no blocks


@pytest.mark.parametrize("reservation, slab", [("max", 64), ("pow2", 32), ("oracle", 20)])
def test_slab_sizes_and_the_memory_breakdown(reservation, slab):
    o = contiguous(reservation=reservation, max_context=64)
    o.prefill(0, 12, "a", 20, step=0)  # 12 tokens now, 20 at the end
    led = o.expected_ledger()
    assert led.seq_blocks == {0: slab}
    assert led.token_states == 12
    assert led.reservation == 8        # 20 - 12 slots later tokens will use
    assert led.internal_fragmentation == slab - 20
    assert led.external_fragmentation == 0 and led.free == 128 - slab
    assert led.fragmentation == (slab - 12) / slab


def test_contiguous_fork_copies_the_whole_slab():
    o = contiguous(reservation="pow2")
    o.prefill(0, 12, "a", 20, step=0)      # slab 32 at 0
    o.fork(1, 0, 30, step=1)               # slab next_pow2(30) = 32 at 32
    assert o.seqs[1].slabs[0] == (32, 32) and o.seqs[1].tokens == 12
    assert o.expected_ledger().token_states == 24  # no sharing: 12 twice


def test_contiguous_max_refuses_a_sequence_beyond_max_context():
    o = contiguous(reservation="max", max_context=32)
    with pytest.raises(ValueError, match="beyond max_context 32"):
        o.prefill(0, 12, "a", 33, step=0)


def test_contiguous_out_of_memory_and_eviction():
    o = contiguous(num_blocks=4, policy="lru")  # 64 slots
    o.prefill(0, 30, "a", 30, step=0)
    o.prefill(1, 30, "a", 30, step=1)
    # 10 slots needed: 4 free at the end; evicting 0 opens [0, 30).
    assert o.prefill(2, 10, "a", 10, step=2) == [0]
    assert o.seqs[2].slabs[0] == (0, 10)
    with pytest.raises(ModelOOM):
        o.prefill(3, 65, "a", 65, step=3)


# --- purity -------------------------------------------------------------------------------

def test_step_is_pure():
    o = paged(num_blocks=4)
    o.prefill(0, 20, "a", 20, step=0)
    before, led = snapshot(o), o.expected_ledger()
    nxt, victims = step(o, ("prefill", dict(seq=1, tokens=16, tenant="a", final=16, step=1)))
    assert victims == [] and set(nxt.seqs) == {0, 1}
    assert snapshot(o) == before and o.expected_ledger() == led
    same, victims = step(o, ("prefill", dict(seq=2, tokens=80, tenant="a", final=80, step=1)))
    assert victims is None and same is o and snapshot(o) == before


def test_fair_tie_on_excess_goes_to_the_larger_tenant_id():
    # The reference page picks max(over, key=(excess, tenant)): an exact tie on excess goes to
    # the larger tenant id (docs/architecture.md, "Fair ties"); sequence ties go to the smaller id.
    # Weights a 1, b 1, c 2 over 8 blocks: quotas 2, 2 and 4.
    o = paged(num_blocks=8, policy="fair", tenant_weights={"a": 1, "b": 1, "c": 2})
    o.prefill(1, 48, "b", 48, step=0)   # b: 3 blocks, over by 1
    o.prefill(0, 48, "a", 48, step=1)   # a: 3 blocks, over by 1
    o.prefill(2, 32, "c", 32, step=2)   # c: 2 blocks, under
    # a and b are over by exactly 1: the tie goes to tenant "b", whose only sequence is 1.
    assert o.prefill(3, 16, "c", 16, step=3) == [1]


# --- engine rules a backend declares (Capabilities) -------------------------------------------

def engine(num_blocks=64, caching=True, **rules) -> Oracle:
    """An oracle under SPEC's rules with ``rules`` switched (the spec rule set's parameters)."""
    return Oracle(make_config(B, num_blocks, prefix_caching=caching), layout="paged",
                  capabilities=Capabilities(rule_params=rules))


def test_an_unknown_fork_rule_is_refused():
    with pytest.raises(ValueError, match="rule set 'spec': fork_via must be one of"):
        engine(fork_via="clone")


def test_fork_via_copy_computes_every_block_again():
    o = engine(num_blocks=6, caching=False, fork_via="copy")
    o.prefill(0, 40, "a", 40, step=0)
    o.fork(1, 0, 40, step=1)
    led = o.expected_ledger()
    assert led.blocks_used == 3 + 3  # ceil(40/16) each, nothing shared
    assert led.shared_blocks == 0
    assert led.free_slots == 2 * 8  # each copy of the tail holds 40 - 32 = 8 of 16
    with pytest.raises(ModelOOM):  # a third copy needs 3 blocks, 0 are free
        o.fork(2, 0, 40, step=2)
    assert o.blocks_used == 6 and 2 not in o.seqs


def test_fork_via_prefix_shares_the_full_blocks_and_computes_the_tail_again():
    o = engine(fork_via="prefix", caches_every_full_block=True)
    o.prefill(0, 40, "a", 40, step=0)
    o.fork(1, 0, 40, step=1)
    led = o.expected_ledger()
    assert led.shared_blocks == 2  # 40 // 16 full blocks, through the prefix cache
    assert led.blocks_used == 3 + 1  # the parent's 3, and the child's own tail of 40 - 32 tokens
    assert led.prefix_hit_blocks == 0  # a fork is no prompt


def test_fork_via_prefix_with_the_last_token_cap_and_duplicates_computes_the_last_block_again():
    # vLLM: the child's hit stops at (T - 1) // B = (32 - 1) // 16 = 1 block.
    o = engine(fork_via="prefix", caches_every_full_block=True, hit_leaves_last_token=True,
               keeps_duplicate_blocks=True)
    o.prefill(0, 32, "a", 32, step=0)
    o.fork(1, 0, 32, step=1)
    assert o.expected_ledger().shared_blocks == 1
    assert o.blocks_used == 2 + 1
    o.free(0)
    o.free(1)
    assert o.expected_ledger().cached_blocks == 3  # block 2 is cached twice


def test_the_last_token_cap_counts_one_block_less_on_a_whole_hit():
    o = engine(hit_leaves_last_token=True)
    o.prefill(0, 32, "a", 32, step=0, hashes=(7, 8))
    o.free(0)
    o.prefill(1, 32, "a", 32, step=1, hashes=(7, 8))
    led = o.expected_ledger()
    assert led.prefix_hit_blocks == 1  # (32 - 1) // 16
    assert led.blocks_used == 2 and led.cached_blocks == 0  # both cached blocks taken back
    o.prefill(2, 40, "a", 40, step=2, hashes=(7, 8))
    assert o.expected_ledger().prefix_hit_blocks == 1 + 2  # (40 - 1) // 16 = 2: no cap


def test_an_engine_that_keeps_duplicates_computes_the_capped_block_into_a_second_copy():
    o = engine(hit_leaves_last_token=True, keeps_duplicate_blocks=True)
    o.prefill(0, 32, "a", 32, step=0, hashes=(7, 8))
    o.free(0)
    o.prefill(1, 32, "a", 32, step=1, hashes=(7, 8))
    led = o.expected_ledger()
    assert led.prefix_hit_blocks == 1 and led.blocks_used == 2
    assert led.cached_blocks == 1  # the first copy of block 8 stays free and cached
    o.free(1)
    assert o.expected_ledger().cached_blocks == 3  # 7, and 8 twice
    o.prefill(2, 32, "a", 32, step=2, hashes=(7, 8))
    assert o.blocks_used == 2 and o.expected_ledger().cached_blocks == 2


def test_caching_every_full_block_caches_decode_and_unhashed_blocks_under_keys_never_hit():
    o = engine(caches_every_full_block=True)
    o.prefill(0, 40, "a", 48, step=0, hashes=(7,))  # block 0 hashed, block 1 full without a hash
    o.append([0], [8], step=1)  # the tail fills: 48 = 3 * 16
    o.free(0)
    assert o.expected_ledger().cached_blocks == 3  # 48 // 16
    o.prefill(1, 48, "a", 48, step=2, hashes=(7,))
    assert o.expected_ledger().prefix_hit_blocks == 1  # only the hashed block is ever found
    plain = engine()
    plain.prefill(0, 40, "a", 48, step=0, hashes=(7,))
    plain.append([0], [8], step=1)
    plain.free(0)
    assert plain.expected_ledger().cached_blocks == 1  # SPEC: the trace's hashed block only
