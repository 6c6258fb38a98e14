"""SPEC §12's state groups (Mamba / linear attention in hybrid models) in the oracle, the NumPy
and torch pools and the checker: one state per live sequence in the block of its last token,
zeros when fresh, copied on write after a fork, cached at hashed block boundaries, and a prefix
hit only where the state at the hit length is cached."""
from __future__ import annotations

import numpy as np
import pytest
from test_hybrid import trace
from test_kinds import kinds_config, runs

from impls.faults import StateHitsNever, StateNotZeroed, StateOneBoundaryEarly
from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.contract import formulas as F
from kvbench.contract import registry
from kvbench.contract.protocol import Prompt, advance_state, kv_tokens
from kvbench.model.oracle import Oracle

MAMBA = F.get_model("tiny-mamba")
STATE = MAMBA.kv_groups[0]


def test_a_state_group_holds_the_block_of_its_last_token():
    assert [g.kind for g in MAMBA.kv_groups] == ["state(512)"] * 3 + ["full"]
    # 512 = 8 tokens * 2 (K, V) * 1 layer * 2 heads * 8 * 2 bytes: one state of 512 bytes fills it
    assert F.block_bytes(8, MAMBA) == 512
    assert F.state_blocks(STATE, 512) == 1
    assert F.held_blocks(20, STATE, 8) == [2]  # 2 = (20 - 1) // 8
    assert F.released_blocks(20, STATE, 8) == range(0, 2)
    assert F.held_blocks(16, STATE, 8) == [1]  # a hit of 2 blocks needs the state at 16
    assert F.held_blocks(0, STATE, 8) == []


def test_a_pool_refuses_a_state_larger_than_its_block():
    # Block size 4: 4 * 2 * 1 * 2 * 8 * 2 = 256 bytes, the state 512: 2 blocks; 8 holds it.
    with pytest.raises(ValueError, match=r"takes 2 blocks of 256 bytes.*block_size >= 8"):
        NumpyPaged(kinds_config(MAMBA, block_size=4))


def test_each_state_is_the_recurrence_from_zeros_through_prefill_fork_and_decode():
    # 20 tokens, a fork, both decode across the block edge at 24; then free.
    t = trace(("p", 0, 20), ("k", 1, 0), ("a", {0: 5, 1: 1}), ("a", {1: 7}), ("x", 0), ("x", 1))
    for name in runs(MAMBA):
        b = registry.create(name, kinds_config(MAMBA))
        b.prefill(0, Prompt(20, final_tokens=25), kv_tokens(np.zeros(20), np.arange(20), MAMBA))
        want = advance_state(None, kv_tokens(np.zeros(20), np.arange(20), MAMBA)[:, :, [0]])
        assert np.array_equal(b.read_state(0)[0].astype(np.int64), want), name
        assert check(t, registry.create(name, kinds_config(MAMBA)), gather="all").valid is True, name


def test_an_operation_holds_one_state_block_per_state_group_and_a_fork_copies_it():
    o = Oracle(kinds_config(MAMBA))
    o.prefill(0, 20, "t", 20, 0)
    # ceil(20 / 8) = 3 full blocks + 3 state groups * 1 block
    assert o.expected_ledger().blocks_used == 6
    assert o.expected_ledger().group_blocks == (1, 1, 1, 3)
    o.fork(1, 0, 20, 1)  # SPEC §12: the fork copies each state, shares the full blocks
    assert o.expected_ledger().blocks_used == 9  # 9 = 6 + 3 copies
    assert o.expected_ledger().shared_blocks == 3  # the full group's 3 blocks


HASHED = {"block_hashes": [11, 12]}


def test_a_hit_takes_the_full_blocks_and_the_state_at_the_hit_length():
    t = trace(("p", 0, 20, HASHED), ("x", 0), ("p", 1, 20, HASHED), ("x", 1))
    cfg = kinds_config(MAMBA, prefix_caching=True)
    o = Oracle(cfg)
    o.prefill(0, 20, "t", 20, 0, hashes=[11, 12])
    o.free(0)
    o.prefill(1, 20, "t", 20, 2, hashes=[11, 12])
    # 5 = 2 full blocks below 16 + 3 state groups' state at 16 (block 1)
    assert o.expected_ledger().prefix_hit_blocks == 5
    for name in runs(MAMBA):
        v = check(t, registry.create(name, cfg), gather="all")
        assert v.valid is True, f"{name}: {v.divergence}"
        assert v.final_ledger["prefix_hit_blocks"] == 5


def test_no_hit_where_the_state_at_the_hit_length_is_gone():
    o = Oracle(kinds_config(MAMBA, prefix_caching=True))
    o.prefill(0, 20, "t", 20, 0, hashes=[11, 12])
    # Forget the states cached at 16 (block 1 of each state group): the hit falls to 8.
    for g in range(3):
        for b in o.by_hash.pop((g, 12)):
            del o.hash_of[b]
    o.free(0)
    o.prefill(1, 20, "t", 20, 2, hashes=[11, 12])
    # 4 = 1 full block below 8 + 3 states at 8 (block 0)
    assert o.expected_ledger().prefix_hit_blocks == 4


def test_a_state_model_does_not_roll_back_drafts():
    from kvbench.checking.applicable import _lifecycles
    why = str(_lifecycles({"speculative"}, NumpyPaged(kinds_config(MAMBA))))
    # the state kind says what a rollback would need (kinds.StateKind.rollback_needs)
    assert why.startswith("kvbench's model does not roll back drafts over state(")
    assert why.endswith("which would need the state before the drafts (SPEC §12)")


FRESH = (("p", 0, 20), ("x", 0), ("p", 1, 4), ("x", 1))  # 1 takes blocks 0 just gave back
HIT = (("p", 0, 4), ("p", 1, 20, HASHED), ("x", 1), ("x", 0), ("p", 2, 20, HASHED), ("x", 2))


@pytest.mark.parametrize("fault,ops,index,quantity", [
    (StateNotZeroed, FRESH, 2, "state of sequence 1"),  # its block held sequence 0's K/V
    # 6 = 8 cached - 5 hit (2 full + 3 states at 16) + 3 states given back at the end; the
    # fault takes none: 8
    (StateHitsNever, HIT, 4, "cached_blocks"),
    # The state cached at 8 taken for 16's: other blocks go back to the cache, and the state
    # read back is wrong (where the replay stops, going on past the block ids)
    (StateOneBoundaryEarly, HIT, 4, "cached blocks (next evicted first)"),
])
def test_a_planted_state_fault_is_caught_and_its_control_passes(fault, ops, index, quantity):
    t = trace(*ops)
    cfg = kinds_config(MAMBA, prefix_caching=True, num_blocks=16)
    v = check(t, fault(cfg), gather="all")
    assert (v.valid, v.divergence.index, v.divergence.quantity) == (False, index, quantity), v.divergence
    assert check(t, NumpyPaged(cfg), gather="all").valid is True
    if fault is StateOneBoundaryEarly:
        v = check(t, fault(cfg), gather="all", keep_going=True)
        assert [(c["kind"], c["stopped"]) for c in v.divergences][-1] == ("state of sequence N", True)


def test_a_fork_with_no_room_for_its_state_copies_evicts():
    # 12 blocks: 20 tokens hold 3 + 3 states = 6, 4 tokens 1 + 3 = 4; 2 left, and the fork's 3
    # state copies evict the least recently used sequence (0).
    t = trace(("p", 0, 20), ("p", 1, 4), ("k", 2, 1), ("a", {2: 1, 1: 1}), ("x", 1), ("x", 2))
    cfg = kinds_config(MAMBA, num_blocks=12, policy="lru")
    o = Oracle(cfg)
    o.prefill(0, 20, "t", 20, 0)
    o.prefill(1, 4, "t", 4, 1)
    assert o.expected_ledger().blocks_free == 2
    assert o.fork(2, 1, 5, 2) == [0]
    for name in runs(MAMBA):
        v = check(t, registry.create(name, cfg), gather="all")
        assert (v.valid, v.evictions) == (True, 1), f"{name}: {v.divergence}"


def test_a_sequence_of_no_token_reads_a_fresh_state():
    # A trace has no empty prefill; a direct one holds no block, and its state is zeros.
    for name in runs(MAMBA):
        b = registry.create(name, kinds_config(MAMBA))
        b.prefill(0, Prompt(0), kv_tokens([], [], MAMBA))
        assert not b.read_state(0).any() and b.read_state(0).shape == (3, 2, 1, 2, 8)
