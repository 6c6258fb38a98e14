"""Speculative decoding by vLLM's rules, declared (SPEC §13): rejected drafts' blocks kept as
lookahead slots (``Capabilities.lookahead_slots``) and an EAGLE hit's last block computed again
(``hit_drops_last_block``). The oracle's ledger from the formulas; the NumPy pools that declare
them pass the checker, and one that keeps the blocks without declaring it fails where the
first kept block shows."""
from __future__ import annotations

import dataclasses

import pytest
from conftest import P, X, make_config, make_trace
from test_lifecycles import LIFECYCLE_TRACE

from impls.numpy_lookahead import NumpyEagle, NumpyLookahead
from kvbench.analyses import suite
from kvbench.checking.checker import check
from kvbench.contract.protocol import Backend, Capabilities
from kvbench.model.oracle import ModelOOM, Oracle
from kvbench.traces.ops import Accept, Append, Prefill

LOOKAHEAD = Capabilities(rule_params={"lookahead_slots": True})


def test_a_rejected_drafts_block_stays_the_sequences_until_its_next_append_writes_it():
    o = Oracle(make_config(num_blocks=8), capabilities=LOOKAHEAD)
    o.prefill(0, 20, "a", 60, 0)  # ceil(20 / 16) = 2 blocks
    o.append([0], [17], 1, drafts=[16])  # 37 tokens: ceil(37 / 16) = 3 blocks
    o.accept(0, 16, 2, 2)  # 37 - (16 - 2) = 23 tokens: 2 blocks hold them, the third is kept
    led = o.expected_ledger()
    assert (led.blocks_used, led.seq_blocks, led.token_states, led.tokens) == (3, {0: 3}, 23, {0: 23})
    free_before = o.free_list().tolist()
    o.append([0], [12], 3)  # 35 tokens: 9 fill the tail (32 - 23), 3 go into the kept block
    led = o.expected_ledger()
    assert (led.blocks_used, led.token_states) == (3, 35)
    assert o.free_list().tolist() == free_before  # no new block taken
    o.free(0)
    assert o.expected_ledger().blocks_free == 8


def test_a_kept_block_is_no_other_sequences_room():
    o = Oracle(make_config(num_blocks=4), capabilities=LOOKAHEAD)
    o.prefill(0, 20, "a", 60, 0)
    o.append([0], [17], 1, drafts=[16])
    o.accept(0, 16, 2, 2)  # 3 blocks in use, one of them kept: 4 - 3 = 1 free
    with pytest.raises(ModelOOM):
        o.prefill(1, 20, "a", 20, 3)  # ceil(20 / 16) = 2 blocks > 1
    plain = Oracle(make_config(num_blocks=4))
    plain.prefill(0, 20, "a", 60, 0)
    plain.append([0], [17], 1, drafts=[16])
    plain.accept(0, 16, 2, 2)  # the third block released: 4 - 2 = 2 free
    plain.prefill(1, 20, "a", 20, 3)


def test_an_eagle_hit_drops_its_last_matched_block():
    o = Oracle(make_config(num_blocks=16, prefix_caching=True),
               capabilities=Capabilities(prefix_caching=True,
                                         rule_params={"hit_drops_last_block": True}))
    o.prefill(0, 50, "a", 50, 0, hashes=("h0", "h1", "h2"))
    o.prefill(1, 50, "a", 50, 1, hashes=("h0", "h1", "h2"))
    assert o.hit_blocks == 3 - 1
    o.prefill(2, 20, "a", 20, 2, hashes=("h0",))
    assert o.hit_blocks == 2 + (1 - 1)


def test_a_block_of_kept_drafts_is_cached_at_the_next_append_where_declared():
    def run(later: bool, append_first: bool) -> int:
        o = Oracle(make_config(num_blocks=8, prefix_caching=True), capabilities=Capabilities(
            prefix_caching=True, rule_params={"caches_every_full_block": True,
                                              "kept_drafts_cached_at_next_append": later}))
        o.prefill(0, 14, "a", 40, 0)
        o.append([0], [5], 1, drafts=[4])  # 19 tokens, drafts at 15 .. 18
        o.accept(0, 4, 4, 2)  # all kept: block 0 (positions 0 .. 15) full of kept tokens
        if append_first:
            o.append([0], [1], 3)
        o.free(0)
        return o.expected_ledger().cached_blocks
    assert (run(False, False), run(True, False)) == (1, 0)  # cached at the accept; never
    assert run(True, True) == 1  # cached by the append after it


# 0 keeps a block from its rollback (20 + 17 - 14 = 23 tokens in 2 blocks of 3); 1 takes the
# fourth and last; a batch where 0 writes 12 (9 into its tail, 3 into its kept block) and 1 one
# token into a new block finds no block: refused, every ledger as it was; 0 alone then fits.
KEPT_UNDER_PRESSURE = make_trace(
    P(0, 20), Append(0, (0,), (17,), (16,)), Accept(0, 0, 2), P(1, 16),
    Append(0, (0, 1), (12, 1)), Append(0, (0,), (12,)), X(1), X(0))


@pytest.mark.parametrize("cls", [NumpyLookahead, NumpyEagle])
def test_the_lookahead_pools_pass_the_lifecycles_and_a_refusal_with_kept_blocks(cls):
    v = check(LIFECYCLE_TRACE, cls(make_config(num_blocks=32, prefix_caching=True)), gather="all")
    assert v.valid is True, str(v.divergence)
    v = check(KEPT_UNDER_PRESSURE, cls(make_config(num_blocks=4)), gather="all")
    assert v.valid is True, str(v.divergence)
    assert v.ooms == 1
    assert "block structures" in v.skipped


def test_keeping_the_blocks_without_declaring_it_fails_at_the_first_kept_block():
    undeclared = type("Undeclared", (NumpyLookahead,), {"capabilities": dataclasses.replace(
        NumpyLookahead.capabilities, rule_params={"lookahead_slots": False})})
    trace = suite.load_traces([suite.WORKLOADS_DIR / "lifecycle-speculative.jsonl"])[0]
    assert check(trace, NumpyLookahead(suite.config_for(trace))).valid is True
    v = check(trace, undeclared(suite.config_for(trace)))
    # 2 grows 63 -> 68 -> 71 -> 76, then 81 with 3 of 4 drafts kept: 80 = 5 * 16, so block 5
    # lies wholly past it: released by SPEC's rule, kept by the pool (one more in use)
    d = v.divergence
    assert (d.step, d.quantity, d.actual - d.expected) == (18, "blocks_used", 1)


def test_an_eagle_hit_short_of_its_lookahead_block_fails_at_the_hit():
    from impls.faults import EagleBlockUncached
    # 0: 48 tokens, 3 full blocks h0 .. h2; 1's prompt h0 .. h3 (64 tokens) matches 3 and, EAGLE
    # dropping the last, hits 2: 3 + (4 - 2) = 5 blocks in use. The fault left h2 (0's last full
    # block) uncached: 1 matches 2, hits 1: 3 + (4 - 1) = 6.
    trace = make_trace(Prefill(0, 0, "a", 48, ("h0", "h1", "h2")),
                       Prefill(0, 1, "a", 64, ("h0", "h1", "h2", "h3")), X(1), X(0))
    config = make_config(num_blocks=16, prefix_caching=True)
    assert check(trace, NumpyEagle(config), gather="all").valid is True
    # Its KV events (SPEC §14) show the missing entry first, at the prefill: h2 never stored.
    d = check(trace, EagleBlockUncached(config), gather="all").divergence
    assert (d.step, d.quantity) == (0, "residency of group 0, tier 0") and "['h2']" in d.detail
    silent = type("Silent", (EagleBlockUncached,), {"events": Backend.events})  # the hit alone
    v = check(trace, silent(config), gather="all")
    d = v.divergence
    assert (v.valid, d.step, d.quantity, d.expected, d.actual) == (False, 1, "blocks_used", 5, 6)


def test_a_second_fork_hits_the_blocks_a_first_fork_computed_of_its_parents_kept_drafts():
    # vLLM's rules (a fork is a new request of the parent's tokens; a block kept drafts filled is
    # cached at the parent's next append). One-token blocks: 0 prefills 1 token, 1 is its fork,
    # 1 appends 5 drafts and keeps 2 (3 tokens: blocks 1 and 2 full of kept drafts, uncached).
    # Fork 2 hits block 0 and computes blocks 1 and 2 (the parent's content); fork 3 then hits
    # those, up to its last token: 2 blocks, 1 new.
    caps = Capabilities(prefix_caching=True, rule_params={
        "caches_every_full_block": True, "keeps_duplicate_blocks": True,
        "hit_leaves_last_token": True, "fork_via": "prefix", "lookahead_slots": True,
        "kept_drafts_cached_at_next_append": True})
    o = Oracle(make_config(block_size=1, num_blocks=11, prefix_caching=True), capabilities=caps)
    o.prefill(0, 1, "a", 1, 0)
    o.fork(1, 0, 1, 1)  # hits (1 - 1) // 1 = 0: 1 + 1 = 2 in use
    o.append([1], [5], 2, drafts=[5])  # 1 + 5 = 6 tokens: 2 + 5 = 7 in use
    o.accept(1, 5, 2, 3)  # 3 tokens, 3 kept lookahead blocks: still 7
    o.fork(2, 1, 3, 4)  # hits block 0 alone: 7 + (3 - 1) = 9
    assert o.expected_ledger().blocks_used == 9
    o.fork(3, 1, 3, 5)  # hits (3 - 1) // 1 = 2 blocks (0, and 1 from fork 2): 9 + (3 - 2) = 10
    assert o.expected_ledger().blocks_used == 10
