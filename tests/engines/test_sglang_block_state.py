"""SGLang's RadixCache block structures under the checker (``SglangRadix.block_state``): its free
pages, its evictable leaves in the order its eviction takes them, each tree page's lock count.

Opt-in like every SGLang test (skipped with the reason where SGLang is not installed). The
adapter's rule set evicts whole leaves (``evicts_whole_leaves``): the checker reads the structures after every operation and
compares the leaves' order with the oracle's radix tree (kvbench/model/rules/sglang.py), the
engine's pages paired with the oracle's blocks through the tables; the lock counts must be one
per table holding the page (SPEC §10's reference identity). The two planted regressions of
impls/engines/faults_engines.py FAIL there, before the ledger alone shows them.
"""
from __future__ import annotations

from pathlib import Path

from conftest import make_config, without_block_state

from kvbench.analyses.suite import config_for, load_traces
from kvbench.checking.checker import check
from kvbench.contract.protocol import Prompt

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def workload(name: str):
    return load_traces([WORKLOADS / f"{name}.jsonl"])[0]


def run(cls, trace, ledger_only: bool = False):
    if ledger_only:  # the check as it was before block_state: ledger and figures alone
        cls = without_block_state(cls)
    return check(trace, cls(config_for(trace, policy=None, prefix_caching=True)))


def test_the_structures_are_sglangs_own(sglang):
    """Page size 16, 8 pages. Sequence 0: 40 tokens, hashes a, b (2 full pages in one tree node,
    40 - 32 = 8 tokens in a private page); sequence 1: 20 tokens under "a", whose match
    (19 // 16 = 1 page) splits the node into [a] above [b], and 4 tokens in a private page."""
    from impls.engines.sglang_radix import SglangRadix
    be = SglangRadix(make_config(16, 8, store_kv=False, prefix_caching=True))
    be.prefill(0, Prompt(40, block_hashes=["a", "b"]))
    be.prefill(1, Prompt(20, block_hashes=["a"]))
    st = be.block_state()
    (a, b, tail0), = st.tables[0]
    (shared, tail1), = st.tables[1]
    assert shared == a
    ref = st.refcount
    assert (ref[a], ref[b], ref[tail0], ref[tail1]) == (2, 1, 1, 1)  # [a]'s locks: both requests
    assert len(st.free) == 8 - 4 and list(st.cached) == []
    be.free(1)
    be.free(0)
    st = be.block_state()
    # Idle: the leaf [b] goes first, then [a], childless; the two tails are free pages.
    assert list(st.cached) == [b, a] and not st.refcount.any() and len(st.free) == 8 - 2


def test_a_workload_reads_the_structures_and_passes(sglang):
    from impls.engines.sglang_radix import SglangRadix
    v = run(SglangRadix, workload("prefix-reuse"))
    assert v.valid is True, str(v.divergence)
    assert "block structures" not in v.skipped  # read, not skipped


def test_leaves_given_back_in_reverse_lru_order_fail_at_prefix_reuse_step_9(sglang):
    """prefix-reuse (block size 8): step 5 frees sequence 0, whose one page ("p0.0", block 0)
    becomes the one evictable leaf; step 9 frees sequence 1 (70 + 8 + 6 = 84 tokens: 84 // 8 =
    10 full pages, block 1 .. 9 and the output's), its prompt node and its output leaf unlocked.
    Two leaves now, block 0 touched at step 5, the output leaf at step 9: lru gives block 0
    first, the reversed heap the newest leaf (its parent next, block 0 last). The ledger alone
    sees it only when an eviction takes the wrong leaf, after step 9."""
    from impls.engines.faults_engines import SglangRadixLeavesReversed
    v = run(SglangRadixLeavesReversed, workload("prefix-reuse"))
    d = v.divergence
    assert (d.index, d.quantity) == (9, "cached blocks (next evicted first)"), str(d)
    assert d.expected[0] == 0 and d.actual[-1] == 0  # block 0: first under lru, last reversed
    late = run(SglangRadixLeavesReversed, workload("prefix-reuse"), ledger_only=True)
    assert late.valid is False and late.divergence.index > 9


def test_reversed_leaves_pass_fork_parallel_on_the_ledger_alone_and_fail_on_the_structures(sglang):
    """The issue's case: a wrong eviction order no figure shows on a whole workload."""
    from impls.engines.faults_engines import SglangRadixLeavesReversed
    assert run(SglangRadixLeavesReversed, workload("fork-parallel"), ledger_only=True).valid is True
    v = run(SglangRadixLeavesReversed, workload("fork-parallel"))
    assert v.valid is False and v.divergence.quantity == "cached blocks (next evicted first)"


def test_a_lock_count_one_short_fails_at_the_first_lock_moved_prefix_reuse_step_3(sglang):
    """prefix-reuse: steps 0-2 prefill without a hit (their admission locks are on the root,
    which an unlock never walks); step 3 forks sequence 3 from 2 (40 tokens, 5 full pages,
    blocks 10 .. 14). The parent's checkpoint moves its lock (an unlock, then a lock), the child
    matches 39 // 8 = 4 pages (the node splits: blocks 10 .. 13 on top), locks them, and its
    checkpoint moves that lock too: two unlocks that stop below the top node, each leaving one
    lock there. Block 10 is held by 2 tables; its lock count 2 + 2 = 4. The sizes do not move
    (the node stays locked either way), so the ledger alone sees it only at step 5, where
    sequence 0's one-node path keeps its lock after its free."""
    from impls.engines.faults_engines import SglangRadixLockOneShort
    v = run(SglangRadixLockOneShort, workload("prefix-reuse"))
    d = v.divergence
    assert (d.index, d.quantity, d.expected, d.actual) == (3, "reference count of block 10", 2, 4), str(d)
    late = run(SglangRadixLockOneShort, workload("prefix-reuse"), ledger_only=True).divergence
    assert (late.index, late.quantity) == (5, "blocks_used + blocks_free")
