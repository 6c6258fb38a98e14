"""Preemption by swap (SPEC §13 over the tiers of §11): loading refuses a swap with no tier to go
to, the tiered oracle's ledgers from the formulas (the swapped blocks held in the tier, bytes
moved each way, a tier too full falls back to recompute), and the NumPy pool passes the checker
while a pool that resumes from the wrong slots, or takes the checker's values instead of the
tier's, fails at the resume."""
from __future__ import annotations

import dataclasses
import json

import pytest
from conftest import make_config

from impls.faults_tiers import SwapInReadsAnother
from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.model.tiered import TieredOracle
from kvbench.contract import registry
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, TraceError, loads, validate
from kvbench.traces.ops import Preempt, Resume
from kvbench.traces.tier_ops import Done, Store, TierSpec

HEADER = {"kvbench_trace": 1, "family": "test", "generator": "tests", "params": {}, "seed": 0,
          "tiers": [{"name": "host", "capacity": 4}]}
PREFILL = {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 20}


def test_loading_refuses_a_swap_to_a_tier_the_header_does_not_declare():
    text = "\n".join(json.dumps(d) for d in (HEADER, PREFILL, {"step": 1, "op": "preempt", "seq": 0,
                                                               "mode": "swap", "tier": "disk"}))
    with pytest.raises(TraceError) as e:
        loads(text, "bad.jsonl")
    assert (e.value.path, e.value.line) == ("bad.jsonl", 3)
    assert "swap of sequence 0 to tier 'disk', which the header does not declare (tiers: host)" in e.value.reason
    ok = loads(text.replace('"tier": "disk"', '"tier": "host"'), "ok.jsonl")
    assert [op.kind for op in ok.ops] == ["prefill", "preempt"]


def oracle(capacity=4, num_blocks=8):
    return TieredOracle(make_config(num_blocks=num_blocks, prefix_caching=True),
                        tiers=(TierSpec("host", capacity),))


def test_a_swap_holds_every_block_in_the_tier_and_its_resume_copies_up_those_past_the_hit():
    o = oracle()
    bb = o.block_bytes
    o.prefill(0, 40, "a", 40, 0, hashes=("h0", "h1"))  # ceil(40 / 16) = 3 blocks, 2 hashed
    before = o.expected_content(0)
    assert o.swap_out(0, "host") is True
    host = o.tiers.ledgers()[0]
    # all 3 blocks (the partial tail too) in host: stored 3, free 4 - 3 = 1
    assert (host.stored, host.free, host.bytes_down, host.hits) == (3, 1, 3 * bb, 0)
    assert (o.blocks_used, len(o.evictable)) == (0, 2)  # the device's hashed ones stay cached
    o.swap_in(0, 1)
    host = o.tiers.ledgers()[0]
    # h0, h1 hit on the device: only the tail, 3 - 2 = 1 block, moved up; host empty again
    assert (o.swap_hit, host.stored, host.free, host.bytes_up) == (2, 0, 4, (3 - 2) * bb)
    assert o.expected_content(0) == before and o.tenant_stats["a"].recomputed_tokens == 0


def test_a_swap_the_tier_cannot_hold_is_a_recompute_and_a_free_drops_swapped_blocks():
    o = oracle(capacity=2)
    o.prefill(0, 40, "a", 40, 0)  # 3 blocks > 2 host slots
    assert o.swap_out(0, "host") is False
    assert o.tiers.ledgers()[0].free == 2 and 0 in o.preempted
    o.recompute(0, 1)
    assert o.tenant_stats["a"].recomputed_tokens == 40
    o.prefill(1, 20, "a", 20, 2)  # ceil(20 / 16) = 2 blocks: they fit
    assert o.swap_out(1, "host") is True and o.tiers.ledgers()[0].free == 2 - 2
    o.free(1)  # never resumed: its blocks leave the tier, moved nowhere
    host = o.tiers.ledgers()[0]
    assert (host.stored, host.free, host.bytes_up) == (0, 2, 0)


def test_a_swap_evicts_the_tiers_least_recent_stored_blocks_to_make_room():
    o = oracle(capacity=4)
    o.prefill(0, 32, "a", 32, 0, hashes=("h0", "h1"))
    o.store(0, 0, "host")
    o.done(0, True)  # host: h0, h1 stored (h0 the least recent)
    o.free(0)
    o.prefill(1, 40, "a", 40, 1)  # 3 blocks: 4 - 2 = 2 free, h0 evicted for the third
    assert o.swap_out(1, "host") is True
    host = o.tiers.ledgers()[0]
    assert (host.stored, host.free) == (3 + 1, 0)
    assert o.tiers.stored_keys(0) == {(0, o.prompt_keys(32, ("h0", "h1"))[1])}


def P(seq, tokens, hashes=None):
    return lambda s: Prefill(s, seq, "a", tokens, hashes)


# 0: 45 tokens, ceil(45 / 16) = 3 blocks (h0, h1 hashed); 1: 40 tokens, 3 blocks (g0 hashed),
# whose g0 is stored to host first; both swapped out; 0 resumes (h0, h1 still cached on the
# device: its tail alone copied up) while 1 is in host, then 1 resumes, is swapped again and freed
SWAPS = [P(0, 40, ("h0", "h1")), lambda s: Append(s, (0,), (5,)), P(1, 40, ("g0",)),
         lambda s: Store(s, 0, 1, "host"), lambda s: Done(s, 0, True),
         lambda s: Preempt(s, 0, "swap"), lambda s: Preempt(s, 1, "swap"),
         P(2, 60), lambda s: Resume(s, 0), lambda s: Free(s, 2),
         lambda s: Resume(s, 1), lambda s: Append(s, (0, 1), (3, 3)),
         lambda s: Preempt(s, 1, "swap"), lambda s: Free(s, 1), lambda s: Free(s, 0)]


def swap_trace(capacity=4):
    header = Header("swaps", tiers=(TierSpec("host", capacity),))
    return validate(Trace(header, [m(i) for i, m in enumerate(SWAPS)], name="swaps"))


def run(backend_cls, capacity=4, **kw):
    backend = backend_cls(make_config(num_blocks=8, prefix_caching=True))
    try:
        return check(swap_trace(capacity), backend, **kw)
    finally:
        backend.close()


# host of 4: 0's 3 blocks take the 4 - 1 (g0) = 3 free slots; 1's 3 do not fit even evicting g0
# (0 + 1 < 3): recomputed, 40 tokens. Host of 6: 6 - 1 - 3 = 2 free, g0 evicted for the third.
@pytest.mark.parametrize("pool", ["numpy", "torch"])
@pytest.mark.parametrize("capacity, recomputed", [(4, 40), (6, 0)])
def test_the_paged_pools_pass_swaps_fallbacks_and_a_free_while_swapped(pool, capacity, recomputed):
    v = run(registry.resolve(pool).load(), capacity, gather="all")
    assert v.valid is True, str(v.divergence)
    assert (v.preemptions, v.recomputed_tokens) == (3, recomputed)


def test_a_resume_from_another_sequences_slots_fails_at_the_resume():
    # host of 6: 0 resumes at step 8 while 1, swapped out last, is still there
    v = run(SwapInReadsAnother, capacity=6)
    assert v.valid is False
    assert (v.divergence.step, v.divergence.quantity) == (8, "kv of sequence 0")


class TakesTheCheckersValues(NumpyPaged):
    """A resume that writes the K/V it is handed instead of copying up the tier's."""

    def _copy_up(self, t, slots, blocks):
        if not getattr(self, "_resuming", False):
            super()._copy_up(t, slots, blocks)

    def _swapped_up(self, seq, hit):  # swap_in's and resume's copy up
        self._resuming = True
        try:
            super()._swapped_up(seq, hit)
        finally:
            self._resuming = False


def test_a_resume_that_takes_the_values_handed_to_it_fails_at_the_resume():
    v = run(TakesTheCheckersValues)
    assert v.valid is False
    assert (v.divergence.step, v.divergence.quantity) == (8, "kv of sequence 0")


@pytest.mark.parametrize("name", ["contiguous-max", "python-objects"])
def test_a_backend_without_tiers_or_swap_is_not_applicable_with_the_reason(name):
    entry = registry.resolve(name)
    ok, why = entry.available()
    if not ok:
        pytest.skip(why)
    v = check(swap_trace(), entry.create(make_config(num_blocks=8, prefix_caching=True)))
    assert v.valid is None and "does not declare tiers (SPEC §11)" in v.not_applicable
    no_swap = type("NoSwap", (NumpyPaged,), {"capabilities": dataclasses.replace(
        NumpyPaged.capabilities, swap=False)})
    v = check(swap_trace(), no_swap(make_config(num_blocks=8, prefix_caching=True)))
    assert v.valid is None
    assert v.not_applicable == ("numpy does not preempt by swap over its tiers (SPEC §13), and "
                                "the trace swaps sequences out (swap_out, swap_in)")
