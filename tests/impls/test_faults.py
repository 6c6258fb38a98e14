"""Planted faults: each broken backend is caught at the right step with the right quantity.

Every fault is a small subclass of a correct backend (impls/faults.py, which `kvbench faults`
also replays over the default suite). For each, a short trace where the fault shows; the comment says why the checker must part ways with it exactly there. The same trace
passes the correct backend (the control), so what the checker reports is the fault.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
from conftest import A, K, P, X, make_config, make_trace

from impls.contiguous import Contiguous
from impls.faults import (
    BestFit,
    ChunkCachedBeforeComplete,
    CopyWithoutData,
    EvictsServed,
    FairByUsage,
    FairInFloat,
    FloorBlocks,
    ForkWithoutData,
    LeakyAppend,
    LeakyPrefill,
    LfuWithoutRecency,
    LruTiesWrongWay,
    NoCopyOnWrite,
    PoolFragmentation,
    RejectedDraftsCached,
    ResumeIntoOldBlocks,
    RollbackKeepsTailFill,
    SharedCountedTwice,
)
from impls.numpy_paged import NumpyPaged
from kvbench.checking.checker import check
from kvbench.traces.ops import Accept, Append, Preempt, Prefill, Resume

# --- where each one shows -------------------------------------------------------------------

@dataclass
class Case:
    fault: type
    config: dict
    trace: object
    index: int  # operation number; equal to the step in these traces
    quantity: str
    expected: object
    actual: object


CASES = {
    # Prefill 40 = 16 + 16 + 8, fork: 3 shared blocks. Step 2: 1 writes into the shared tail,
    # which must first be copied: ceil(40/16) + 1 = 4 blocks. In place keeps 3.
    "a-no-copy-on-write": Case(NoCopyOnWrite, {}, make_trace(P(0, 40), K(1, 0), A((1, 1),)),
                               2, "blocks_used", 4, 3),
    # Same trace; the ledger is right but 1's copy of the tail lacks the 8 tokens 0 wrote at
    # positions 32..39, so gather(1) differs at step 2.
    "a-copy-without-data": Case(CopyWithoutData, {}, make_trace(P(0, 40), K(1, 0), A((1, 1),)),
                                2, "kv of sequence 1", "what it wrote or inherited", "different values"),
    # 16 tokens fill one block; appending 20 needs ceil(20/16) = 2 new blocks, floor gives 1.
    "b-floor": Case(FloorBlocks, {}, make_trace(P(0, 16), A((0, 20),)), 1, "blocks_used", 3, 2),
    # 20 tokens in 2 blocks of 16: 12 free of 32 in use. Over the 8-block pool: 108 of 128.
    "c-pool-fragmentation": Case(PoolFragmentation, {"num_blocks": 8}, make_trace(P(0, 20)),
                                 0, "fragmentation", 12 / 32, 108 / 128),
    # Step 0 agrees (3 = 3); the fork at step 1 shares 3 blocks: 3 in use, 6 counted per table,
    # and 6 used + 61 free is not the pool of 64 (SPEC §10: used + free = total).
    "d-shared-twice": Case(SharedCountedTwice, {}, make_trace(P(0, 40), K(1, 0)), 1,
                           "blocks_used + blocks_free", 64, 67),
    # 4 blocks: 0 holds 2; P(1, 48) needs 3 of 2 free: refused at step 1, and the 2 it took leak.
    "e-leaky-prefill": Case(LeakyPrefill, {"num_blocks": 4}, make_trace(P(0, 32), P(1, 48)),
                            1, "blocks_used after a refused prefill", 2, 4),
    # 4 blocks: 0 and 1 hold one full block each; the append needs 1 + ceil(17/16) = 3 of 2 free:
    # refused at step 2. The 2 free blocks vanish from the free stack (blocks_used is unchanged).
    "e-leaky-append": Case(LeakyAppend, {"num_blocks": 4},
                           make_trace(P(0, 16), P(1, 16), A((0, 16), (1, 17))),
                           2, "blocks_free after a refused append", 2, 0),
    # 4 blocks, all used after step 2; 0 and 1 both last accessed at step 2. Step 3 needs one
    # block: the tie (2, 0) < (2, 1) evicts 0 (its 2 blocks are enough). The fault evicts 1.
    "f-lru-ties": Case(LruTiesWrongWay, {"num_blocks": 4, "policy": "lru"},
                       make_trace(P(1, 16), P(0, 16), A((1, 16), (0, 16)), P(2, 16)),
                       3, "victims", [0], [1]),
    # 2 blocks: 1 at step 0, 0 at step 1, one use each. Step 2 needs a block:
    # (uses, last, id) = (1, 0, 1) < (1, 1, 0) evicts 1; without recency (1, 0) < (1, 1) evicts 0.
    "g-lfu-recency": Case(LfuWithoutRecency, {"num_blocks": 2, "policy": "lfu"},
                          make_trace(P(1, 16), P(0, 16), P(2, 16)), 2, "victims", [1], [0]),
    # Weights .1/.2/.3 over 10 blocks: quotas 5/3, 10/3 and 0.3/0.6 * 10 = 5 exactly.
    # a holds 1, b 3, c 5: nobody is over, so step 3 (2 blocks needed, 1 free) evicts the global
    # LRU, 0. In float the quota of c is 4.999999999999999, c is "over", and its sequence 2 goes.
    "h-fair-float": Case(FairInFloat,
                         {"num_blocks": 10, "policy": "fair", "tenant_weights": {"a": 0.1, "b": 0.2, "c": 0.3}},
                         make_trace(P(0, 16, "a"), P(1, 48, "b"), P(2, 80, "c"), P(3, 32, "b"),
                                    tenants={"a": 0.1, "b": 0.2, "c": 0.3}),
                         3, "victims", [0], [2]),
    # Weights a 1, b 3 over 8 blocks: quotas 2 and 6. b holds 5 (under), a holds 2 + 1 = 3 (over).
    # Step 3 needs a block: a's LRU, 1, goes. By usage, b (5 blocks) would lose 0 though under quota.
    "i-fair-under-quota": Case(FairByUsage, {"num_blocks": 8, "policy": "fair", "tenant_weights": {"a": 1, "b": 3}},
                               make_trace(P(0, 80, "b"), P(1, 32, "a"), P(2, 16, "a"), P(3, 16, "b"),
                                          tenants={"a": 1, "b": 3}),
                               3, "victims", [1], [0]),
    # 2 blocks, both full. Step 2: 0 appends and needs a block; 0 is the LRU but it is being
    # served, so 1 goes. The fault evicts 0 itself.
    "j-evicts-served": Case(EvictsServed, {"num_blocks": 2, "policy": "lru"},
                            make_trace(P(0, 16), P(1, 16), A((0, 1),)), 2, "victims", [1], [0]),
    # 64 slots, exact reservation: 0 at [0, 10), 1 at [10, 55); free 0 leaves holes of 10 at 0
    # and 9 at the end. First fit puts 9 slots at 0: last end 55 - 54 reserved = 1 slot of holes.
    # Best fit takes the tighter end hole: last end 64, 10 slots of holes.
    "contiguous-best-fit": Case(BestFit, {"num_blocks": 4, "reservation": "oracle"},
                                make_trace(P(0, 10), P(1, 45), X(0), P(2, 9)),
                                3, "external_fragmentation", 1, 10),
    # A fork must copy the slab: 1's tokens 0..11 are 0's, zeros here.
    "contiguous-fork-without-data": Case(ForkWithoutData, {"reservation": "oracle"},
                                         make_trace(P(0, 12), K(1, 0)),
                                         1, "kv of sequence 1", "what it wrote or inherited", "different values"),
    # Scheduler lifecycles (SPEC §13). 20 + 5 tokens (4 of them drafts) = 25 in 2 blocks; keeping
    # 1 of the 4 leaves 22: free slots 2 * 16 - 22 = 10. With the tail's fill left at 25 - 16 = 9
    # the fault counts 16 + 9 = 25 written: 32 - 25 = 7.
    "rollback-keeps-tail-fill": Case(RollbackKeepsTailFill, {},
                                     make_trace(P(0, 20), Append(0, (0,), (5,), (4,)), Accept(0, 0, 1)),
                                     2, "free_slots", 10, 7),
    # 16 + 4 drafts = 20 tokens in 2 blocks; none kept: block 1 lies wholly past 16 tokens and is
    # released to the free pool (no hash: not cached). The fault cached it when it was written.
    "rejected-drafts-cached": Case(RejectedDraftsCached, {},
                                   make_trace(P(0, 16), Append(0, (0,), (4,), (4,)), Accept(0, 0, 0)),
                                   2, "cached_blocks", 0, 1),
    # 0 writes 24 of its 40-token prompt: ceil(24 / 16) = 2 blocks, block h1 holds 8 of 16 tokens,
    # so only h0 is an entry. Its KV events (SPEC §14) show the fault at once: h1 stored too, which
    # no key of the model's stands for. (Without events, 1's prompt (h0, h1) would hit h0 only and
    # take 2 - 1 = 1 block, 2 + 1 = 3 in use, where the fault hits h1 too: 2 + 0 = 2.)
    "chunk-cached-before-complete": Case(
        ChunkCachedBeforeComplete, {"prefix_caching": True},
        make_trace(Prefill(0, 0, "a", 24, ("h0", "h1"), prompt_tokens=40),
                   Prefill(0, 1, "a", 32, ("h0", "h1"))),
        0, "residency of group 0, tier 0", {"stored": ["h0"], "removed": []},
        {"stored": ["h0", "backend key 'h1'"], "removed": []}),
    # 0's blocks 0 and 1 go back at its preemption (tail first: block 0 on top), 1's prompt
    # takes them; 0's resume takes blocks 2 and 3, and the fault fills them from 0 and 1, which
    # hold 1's K/V by then.
    "resume-into-old-blocks": Case(ResumeIntoOldBlocks, {},
                                   make_trace(P(0, 32), Preempt(0, 0), P(1, 32), Resume(0, 0)),
                                   3, "kv of sequence 0", "what it wrote or inherited", "different values"),
}


@pytest.mark.parametrize("gather", ["all", "touched"])
@pytest.mark.parametrize("name", CASES)
def test_fault_is_caught_at_its_step(name, gather):
    # 'touched' (the default) reads back only what each operation changed: same step.
    case = CASES[name]
    v = check(case.trace, case.fault(make_config(**case.config)), gather=gather)
    assert v.valid is False, f"{name} went unnoticed"
    d = v.divergence
    assert (d.index, d.step, d.quantity) == (case.index, case.index, case.quantity), str(d)
    assert d.expected == case.expected and d.actual == case.actual, str(d)
    assert v.ops == case.index  # every operation before it passed


@pytest.mark.parametrize("name", CASES)
def test_control_passes_the_same_trace(name):
    case = CASES[name]
    correct = Contiguous if issubclass(case.fault, Contiguous) else NumpyPaged
    v = check(case.trace, correct(make_config(**case.config)), gather="all")
    assert v.valid is True, str(v.divergence)


def test_kv_divergence_names_the_first_wrong_position():
    case = CASES["a-copy-without-data"]
    d = check(case.trace, case.fault(make_config()), gather="all").divergence
    # The tail copy holds positions 32..39, written by sequence 0 before the fork.
    assert d.detail == "first wrong position 32 (should hold what sequence 0 wrote there)"
