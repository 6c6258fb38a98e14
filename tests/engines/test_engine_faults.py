"""Planted regressions over the real engine classes (impls/engines/faults_engines.py) FAIL where
the engine they are planted in passes.

Opt-in: each test needs its engine's environment and is skipped elsewhere with the reason. Run::

    PYTHONPATH=$PWD /work/sglang-env/bin/python -m pytest tests/engines/test_engine_faults.py
    PYTHONPATH=$PWD /work/vllm-env/bin/python -m pytest tests/engines/test_engine_faults.py

On a committed workload each fault FAILs at the first operation whose effect it changes, where
the unfaulted adapter passes the same workload (SGLang under its declared rules: whole leaves, a
page per request, the capped hit's page computed again); on a hand trace the step and quantity
follow from the formulas.
"""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_config, without_block_state

from kvbench.analyses.suite import config_for, load_traces
from kvbench.checking.checker import check
from kvbench.traces.format import Free, Header, Prefill, Trace, validate
from kvbench.model.rules import rule_set

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"


def _engine(module: str, not_installed: str, why: str):
    import importlib
    ok, reason = importlib.import_module(module).available()
    if not ok and reason == not_installed:
        pytest.skip(why)
    assert ok, reason  # installed but broken: say so, never skip


@pytest.fixture(scope="module")
def sglang():
    from impls.engines.sglang_radix import NOT_INSTALLED
    _engine("impls.engines.sglang_radix", NOT_INSTALLED,
            "SGLang is not installed (opt-in): see docs/engines.md for its recipe")


@pytest.fixture(scope="module")
def vllm():
    from impls.engines.vllm_blockpool import NOT_INSTALLED
    _engine("impls.engines.vllm_kvmanager", NOT_INSTALLED,
            "vLLM is not installed (opt-in): see docs/engines.md for its recipe")


def workload(name: str):
    return load_traces([WORKLOADS / f"{name}.jsonl"])[0]


def hand(*ops, block_size: int):
    return validate(Trace(Header(family="test", settings={"block_size": block_size}), list(ops),
                          name="hand"))


def caught(trace, good, bad, cfg, op: str):
    """``good`` passes ``trace``; ``bad`` FAILs it, at an operation of kind ``op``."""
    v = check(trace, good(cfg))
    assert v.valid, str(v.divergence)
    w = check(trace, bad(cfg))
    assert w.valid is False and w.divergence is not None, w.status
    assert w.divergence.op["op"] == op, str(w.divergence)
    return w.divergence


# --- SGLang -----------------------------------------------------------------------------------

def test_an_eviction_of_a_locked_node_fails_fork_wide(sglang):
    """fork-wide fills its pool with forks of one prompt: an append has to evict, and with the
    locks dropped the tree takes pages running requests hold, which the pool hands out again."""
    from impls.engines.faults_engines import Sglang, SglangEvictsLocked
    trace = workload("fork-wide")
    d = caught(trace, Sglang, SglangEvictsLocked, config_for(trace, policy=None, prefix_caching=True),
               "append")
    assert d.quantity in ("blocks_used", "blocks_used + blocks_free", "shared_blocks"), str(d)


def test_an_eviction_of_a_locked_node_fails_where_a_cached_leaf_was_enough(sglang):
    """Page size 1, 4 pages: sequence 0 holds 2 (locked), sequence 1 leaves 1 cached; a 2-token
    prefill finds 1 free and evicts the cached leaf (1 = 2 - 1, exactly the shortfall). With the
    locks dropped the least recently used leaf is sequence 0's, in use."""
    from impls.engines.faults_engines import Sglang, SglangEvictsLocked
    ops = [Prefill(0, 0, "a", 2, ()), Prefill(1, 1, "a", 1, ()), Free(2, 1),
           Prefill(3, 2, "a", 2, ())]
    cfg = make_config(1, 4, store_kv=False, prefix_caching=True)
    d = caught(hand(*ops, block_size=1), Sglang, SglangEvictsLocked, cfg, "prefill")
    assert d.index == 3


def test_the_whole_requirement_eviction_fails_where_the_shortfall_was_a_leaf(sglang):
    """SGLang PR #32016 ("evict only the KV shortfall"). Page size 1 (exact demand), 4 pages:
    two 1-token leaves cached, one page live; a 2-token prefill finds 1 free, so the shortfall is
    2 - 1 = 1 page: one leaf goes (the oldest, as kvbench's rule) and 1 stays cached. The whole
    requirement (2) takes both leaves: cached_blocks 0."""
    from impls.engines.faults_engines import Sglang, SglangWholeRequirement
    ops = [Prefill(0, 0, "a", 1, ()), Free(1, 0), Prefill(2, 1, "a", 1, ()), Free(3, 1),
           Prefill(4, 2, "a", 1, ()), Prefill(5, 3, "a", 2, ())]
    cfg = make_config(1, 4, store_kv=False, prefix_caching=True)
    d = caught(hand(*ops, block_size=1), Sglang, SglangWholeRequirement, cfg, "prefill")
    assert (d.index, d.quantity, d.expected, d.actual) == (5, "cached_blocks", 1, 0)  # 1 = 2 - 1


def test_the_whole_requirement_eviction_fails_prefix_reuse_at_step_10(sglang):
    """PR #32016's regression on a committed workload. prefix-reuse (B = 8, 27 pages) at step 10:
    live 11 pages (sequence 2: 56 tokens, 7; 3: its fork, 1 of its own; 4: 12 tokens, 2; 5: its
    fork, 1 of its own), cached 11 (sequence 0's one full block, sequence 1's 84 // 8 = 10 in two
    leaves: its prompt's 8 and its output's 2), free 27 - 22 = 5. The append of 8 tokens to
    sequences 4, 5, 3 asks for 24 + 3 * 8 = 48 tokens = 6 pages: the shortfall is 1 page, one
    leaf, sequence 0's (released first): 10 stay cached. The whole requirement (48 tokens > 40
    free) evicts 6 pages' worth: 1, then 2, then the prompt's 8: none stay."""
    from impls.engines.faults_engines import Sglang, SglangWholeRequirement
    trace = workload("prefix-reuse")
    d = caught(trace, Sglang, SglangWholeRequirement,
               config_for(trace, policy=None, prefix_caching=True), "append")
    assert (d.index, d.quantity, d.expected, d.actual) == (10, "cached_blocks", 11 - 1, 0)


# --- vLLM -------------------------------------------------------------------------------------

def test_a_block_freed_twice_fails_prefix_reuse(vllm):
    """prefix-reuse's requests share their prompt's blocks: freeing one request's blocks twice
    puts a block another request holds back on the free queue. vLLM's own structures show which
    (block_state: free in its queue, held by sequence 3's table); the ledger alone, the count
    (blocks_used 8 where 12 are held), at the same free."""
    from impls.engines.faults_engines import VllmFreedTwice, VllmKVManager
    trace = workload("prefix-reuse")
    cfg = config_for(trace, policy=None)
    d = caught(trace, VllmKVManager, VllmFreedTwice, cfg, "free")
    assert (d.step, d.expected, d.actual) == (12, "in use while a table holds it", "free"), str(d)
    assert d.detail == "sequence 3 holds it in group 0" and d.quantity.startswith("block ")
    w = check(trace, without_block_state(VllmFreedTwice)(cfg)).divergence
    assert (w.step, w.quantity) == (12, "blocks_used") and w.actual < w.expected, str(w)


def test_a_block_freed_twice_under_sparse_retention_fails_hybrid_windows(vllm):
    """hybrid-windows with prefix caching, at vLLM's serving default (sparse retention of window
    blocks, the declared rule the unfaulted manager passes): its requests share prompt blocks in
    both groups, and the free of sequence 1 at step 9 hands blocks sequences still hold back to
    the pool, so fewer blocks are in use than the tables hold."""
    from impls.engines.faults_engines import VllmFreedTwice, VllmKVManager
    trace = workload("hybrid-windows")
    cfg = config_for(trace, policy=None, prefix_caching=True)
    assert rule_set(VllmKVManager(cfg).capabilities).sparse_window_retention
    d = caught(trace, VllmKVManager, VllmFreedTwice, cfg, "free")
    assert (d.step, d.op["seq"], d.quantity) == (9, 1, "sum of group_blocks"), str(d)
    assert d.expected < d.actual  # blocks_used below the blocks the tables hold


def test_a_window_block_released_early_fails_hybrid_decode(vllm):
    """hybrid-decode decodes past the sliding window: a release one block ahead of the tokens
    computed drops a block the window still covers (fewer blocks in use than the rule keeps),
    at its first append (step 3), at the serving default."""
    from impls.engines.faults_engines import VllmKVManager, VllmWindowEarly
    trace = workload("hybrid-decode")
    d = caught(trace, VllmKVManager, VllmWindowEarly, config_for(trace, policy=None), "append")
    assert d.step == 3 and d.quantity == "blocks_used" and d.actual < d.expected, str(d)


def test_a_checkpoint_the_retention_does_not_keep_zeroes_every_mamba_hit_at_variant_mamba_step_2(vllm):
    """vLLM #54360: the checkpoint backed off a block for EAGLE, the retention keeping the
    boundary without the drop. variant-mamba's seq 2 (66 tokens) shares seq 1's first 56 + 5
    tokens: served, it hits (61 - 1) // 8 = 7 blocks in the full group and each of the three
    state groups' block 6 (the state at 56), 7 + 3 = 10 hit blocks; planted, the state at 56
    was never cached (seq 1's chunk ended at 48, a block the retention does not keep), and the
    hit is 0."""
    from impls.engines.faults_engines import VllmKVManager, VllmMambaEagleCheckpoint
    trace = workload("variant-mamba")
    cfg = config_for(trace, policy=None, prefix_caching=True)
    d = caught(trace, VllmKVManager, VllmMambaEagleCheckpoint, cfg, "prefill")
    assert d.step == 2, str(d)
    from kvbench.contract.protocol import Prompt
    for cls, hits in ((VllmKVManager, 7 + 3), (VllmMambaEagleCheckpoint, 0)):
        be = cls(cfg)
        for op in trace.ops[:3]:  # three prefills; only the third shares a prefix
            be.prefill(op.seq, Prompt(op.tokens, token_ids=op.token_ids, salt=op.salt,
                                      adapter=op.adapter))
        assert be.ledger().prefix_hit_blocks == hits, cls.name


# --- vLLM's free block queue order (block_state: vLLM's FreeKVCacheBlockQueue) ----------------

MOONCAKE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake" / "synthetic_trace.jsonl"


def test_cached_blocks_appended_reversed_fail_at_the_first_free(vllm):
    """48 = 3 * 16 tokens: blocks 0, 1, 2 (vLLM's 1, 2, 3 less its null block), all hashed. The
    free gives them back tail first, 2, 1, 0 (the oracle's and vLLM's free_blocks(reversed)); the
    planted queue appends them 0, 1, 2, the head to be evicted first. Nothing is evicted on this
    trace, so no count shows it: the order alone does, at the free (op 1). It could be false: a
    checker that compared no order, or whose pairing of vLLM's ids with the oracle's were off."""
    from impls.engines.faults_engines import VllmBlockPool, VllmCachedReversed
    trace = hand(Prefill(0, 0, "a", 48, (1, 2, 3)), Free(1, 0), block_size=16)
    cfg = make_config(block_size=16, num_blocks=8, store_kv=False, prefix_caching=True)
    d = caught(trace, VllmBlockPool, VllmCachedReversed, cfg, "free")
    assert (d.index, d.quantity, d.expected, d.actual) == (
        1, "cached blocks (next evicted first)", [2, 1, 0], [0, 1, 2])
    assert check(trace, without_block_state(VllmCachedReversed)(cfg)).valid is True


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"shared trace not found: {MOONCAKE}")
def test_cached_blocks_appended_reversed_fail_mooncake_at_its_first_free(vllm):
    """The real Mooncake trace, 512-token blocks, 300 in the pool: request 0 (78 hashed blocks,
    then a partial one, uncached) ends at op 1, its blocks cached tail first, 77 .. 0; planted,
    0 .. 77. Without block_state the same fault went on to op 12 (KV events: a victim) and, with
    its events silent too, to op 6,408 (request 3,205: a hit count)."""
    from impls.engines.faults_engines import VllmBlockPool, VllmCachedReversed
    from kvbench.analyses import prefix
    from kvbench.traces.loaders import load_requests
    trace = prefix.cache_trace(load_requests(str(MOONCAKE), "mooncake")[:20], 512)
    hashed = len(trace.ops[0].block_hashes)
    cfg = make_config(block_size=512, num_blocks=300, store_kv=False, prefix_caching=True)
    d = caught(trace, VllmBlockPool, VllmCachedReversed, cfg, "free")
    assert hashed == 78 and (d.index, d.quantity) == (1, "cached blocks (next evicted first)")
    assert d.expected == list(range(hashed))[::-1] and d.actual == list(range(hashed))
    w = check(trace, without_block_state(VllmCachedReversed)(cfg), gather="none")
    assert w.divergence.index == 12 and w.divergence.quantity.startswith("residency"), str(w.divergence)


def test_cached_blocks_appended_reversed_fail_hybrid_windows_at_step_5_not_as_a_salt(vllm):
    """The same plant in the whole manager's pool, on hybrid-windows (sliding and full groups):
    the append at step 5 releases window blocks and caches five blocks, in the wrong order.
    Without block_state the fault showed only at step 75, blamed on a hit across salts."""
    from impls.engines.faults_engines import VllmKVManager, VllmKVManagerCachedReversed
    trace = workload("hybrid-windows")
    cfg = config_for(trace, policy=None)
    d = caught(trace, VllmKVManager, VllmKVManagerCachedReversed, cfg, "append")
    assert (d.step, d.quantity) == (5, "cached blocks (next evicted first)"), str(d)
    assert d.actual != d.expected and sorted(d.actual) == sorted(d.expected)  # same blocks
    w = check(trace, without_block_state(VllmKVManagerCachedReversed)(cfg)).divergence
    assert w.step == 75 and "a hit across salts" in w.detail, str(w)


# --- vLLM PR 52707: a negative external block count -------------------------------------------

def test_pr_52707_a_negative_external_block_count_fails_lifecycle_speculative_at_step_18(vllm):
    """Sequence 2 (a fork of 63 tokens) appends 5 tokens, 4 of them drafts, at steps 3, 7, 11 and
    15, and keeps 4, 2, 4 and 3 of them: 63 -> 68, 71, 76, then 81 (cdiv(81, 16) = 6 blocks) and
    80 after the accept at step 18 (cdiv(80, 16) = 5). The external hit then asks
    get_new_blocks for 5 - 6 = -1: clamped (0.33), nothing; unclamped, the free queue counts one
    block more than it links: used + free = 256 + 1. Sequences 0 and 1 never reject across a
    block boundary (67, 69, 71, 76 and 68, 71, 74, 77: 5 blocks each time). Could be false: with
    the clamp the driver passes (the control), and a ledger read from the blocks would not see it."""
    from impls.engines.faults_engines import VllmExternalAfterRejection, VllmExternalNegative
    trace = workload("lifecycle-speculative")
    cfg = config_for(trace, policy=None)
    d = caught(trace, VllmExternalAfterRejection, VllmExternalNegative, cfg, "accept")
    assert (d.step, d.op["seq"], d.quantity, d.expected, d.actual) == (
        18, 2, "blocks_used + blocks_free", cfg.num_blocks, cfg.num_blocks + 1), str(d)
def test_a_mamba_lookup_one_block_past_the_candidate_fails_boundary_returns_at_step_34(vllm):
    """vLLM #50630 / PR #48375: the coordinator's EAGLE margin given to the Mamba group, whose
    finder never drops it (planted: 0.33 withholds the margin from Mamba groups). The returns
    rule's sixth case (steps 30-35, B = 8): A is 24 tokens (3 blocks), its state cached at its
    checkpoint (24 - 1) // 8 = 2 blocks; the extension, A plus 1 token, hits A's 3 full blocks
    and the state at 2, so its junction, 3 blocks, caches a state at 24 tokens; A's return (step
    34) is capped at 23 tokens, so the full group hits 23 // 8 = 2 blocks and, served, the state
    at 2: 16 tokens. Planted, the Mamba group looks 2 + 1 = 3 blocks far and takes the state at
    24: a hit of 23 tokens where the full group holds 16 (the KV of tokens 16-22 never computed),
    which vLLM's own allocation asserts on (``_apply_cow``: the state's block past the table)."""
    from impls.engines.faults_engines import VllmKVManager, VllmMambaMargin
    from kvbench.traces import boundaries as bd
    trace = next(t for t in bd.boundary_traces([bd.RETURNS]))
    assert [str(v) for v in bd.RETURNS.cases()[5].values()] == ["3B", "1", "all"]
    cfg = config_for(trace, policy=None, prefix_caching=True)
    d = caught(trace, VllmKVManager, VllmMambaMargin, cfg, "prefill")
    assert (d.step, d.quantity, d.actual) == (5 * 6 + 4, "outcome of prefill", "AssertionError")
    from kvbench.contract.protocol import Prompt
    for cls, hit in ((VllmKVManager, 16), (VllmMambaMargin, 23)):
        be, got = cls(cfg), []
        lookup = be.manager.get_computed_blocks
        be.manager.get_computed_blocks = lambda req, **kw: got.append(lookup(req, **kw)) or got[-1]
        for op in trace.ops[30:34]:
            if isinstance(op, Prefill):
                be.prefill(op.seq, Prompt(op.tokens, token_ids=op.token_ids))
            else:
                be.free(op.seq)
        be.manager.get_computed_blocks(be._v.Request(
            request_id="return", prompt_token_ids=list(trace.ops[34].token_ids),
            sampling_params=be._sampling, pooling_params=None, block_hasher=be._hasher))
        blocks, n_hit = got[-1][0], got[-1][1]
        assert n_hit == hit, cls.name
        assert len(blocks.blocks[3]) * 8 == 16  # the full group (kvbench's last): 2 blocks


def test_compressed_keys_written_at_one_granularity_read_at_another_fail_prefix_reuse_at_step_3(vllm):
    """vLLM-Ascend #10296 (planted: vLLM 0.33 has no compressed manager; its compressed specs,
    ``tokens_per_state > 1``, keep one block size for writes and lookups): blocks written keyed
    by their own B = 8 tokens, looked up keyed by B * 4 = 32 (a compressed group's logical
    block). prefix-reuse, step 3: sequence 3 forks sequence 2 (40 tokens, 5 blocks), a request
    of its 40 tokens capped at 39. Served: 39 // 8 = 4 blocks hit, block 4 computed
    again: 15 + 1 = 16 blocks in use (15 = 1 + ceil(70 / 8) + 5 before). Planted: 39 // 32 = 1
    logical block, keyed by the hash of the first 32 tokens, which names sequence 2's physical
    block 3: served as block 0 (another position's KV), a hit of 32 tokens, and 5 - 1 = 4 blocks
    new: 19."""
    from impls.engines.faults_engines import VllmCompressedKeys, VllmKVManager
    trace = workload("prefix-reuse")
    cfg = config_for(trace, policy=None, prefix_caching=True)
    d = caught(trace, VllmKVManager, VllmCompressedKeys, cfg, "fork")
    assert (d.step, d.quantity, d.expected, d.actual) == (3, "blocks_used", 15 + 1, 15 + 4), str(d)
    from kvbench.checking.driver import replay_steps
    be = VllmCompressedKeys(cfg)
    steps = replay_steps(be, trace)
    for _ in range(4 + 1):  # the counts, then steps 0-3
        next(steps)
    assert be.table(3)[0] is be.table(2)[3]  # block 3's KV served at position 0
