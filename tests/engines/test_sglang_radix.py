"""SGLang's RadixCache and token allocator behind the protocol (impls/engines/sglang_radix.py).

SGLang is opt-in (docs/engines.md's recipe builds /work/sglang-env); CI does not install it, so every
test that needs it is skipped there with the reason (the listing without it is tested in
tests/engines/test_vllm_kvmanager.py). Run them with::

    /work/sglang-env/bin/python -m pytest tests/engines/test_sglang_radix.py

SGLang's prefix cache departs from SPEC's by design, and the adapter declares each rule (whole
radix leaves evicted, in its policy's order; a page per request over-estimated; the capped hit's
page computed again: ``CAPABILITIES`` in impls/engines/sglang_radix.py). The oracle models them
(kvbench/model/rules/sglang.py), so every workload checks clean; each rule is pinned below by a
hand-counted trace that FAILs when SGLang is held to SPEC's rule instead.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from conftest import engine_lifecycle_na, make_config

from kvbench.analyses import prefix
from kvbench.checking.checker import check
from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.contract.protocol import OutOfMemory, Prompt
from kvbench.traces.format import Append, Fork, Free, Header, Prefill, Trace, validate
from kvbench.traces.loaders import load_requests

TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[3] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
# RadixCache has no window groups: a workload on a hybrid model (SPEC §8) is n/a, tested apart.
HYBRID = [p for p in committed_workloads() if config_for(load_traces([p])[0], policy=None).model.hybrid]
# Nor lower tiers: a workload with them is n/a (SPEC §11).
ONE_GROUP = [p for p in committed_workloads() if p not in HYBRID and not load_traces([p])[0].header.tiers]
UNHASHED = [p for p in ONE_GROUP if not any(
    getattr(op, "block_hashes", None) for op in load_traces([p])[0].ops)]


def radix(block_size=16, num_blocks=8, caching=True, policy="lru"):
    from impls.engines.sglang_radix import Sglang, SglangRadix, SglangRadixLFU
    cls = {"lru": SglangRadix, "lfu": SglangRadixLFU, "serving": Sglang}[policy]
    return cls(make_config(block_size=block_size, num_blocks=num_blocks, store_kv=False,
                           prefix_caching=caching))


def trace_of(*ops, block_size=16):
    return validate(Trace(Header(family="test", settings={"block_size": block_size}), list(ops),
                          name="hand"))


def held_to_spec(backend, **rule):
    """The backend with one declared rule put back to SPEC's (the oracle then expects SPEC's)."""
    backend.capabilities = dataclasses.replace(
        backend.capabilities, rule_params={**backend.capabilities.rule_params, **rule})
    return backend


def first_divergence(v):
    d = v.divergence
    return (d.index, d.quantity, d.expected, d.actual)


def tree_identity(be) -> None:
    """SPEC §10 with SGLang's own figures: evictable + protected + free + what live requests
    hold outside the tree = the pool (at idle, with nothing held: evictable + protected + free)."""
    f = be.figures()
    P = be.page
    private = sum(-(-(len(r.kv) - r.protected) // P) * P for r in be.reqs.values())
    assert f["evictable"] + f["protected"] + f["available"] + private == f["pool"], (f, private)


# --- which tree: SGLang's serving default -----------------------------------------------------

def test_the_serving_default_is_the_unified_tree_under_lru_and_the_others_say_how_they_differ(sglang):
    """create_tree_cache builds UnifiedRadixCache for a full-attention model; its policy flag
    defaults to lru. Every other SGLang backend names each setting it changes."""
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from kvbench.contract import registry
    cfg = make_config(16, 8, store_kv=False, prefix_caching=True)
    serving = registry.create("sglang", cfg)
    assert type(serving.tree) is UnifiedRadixCache and serving.radix_policy == "lru"
    assert registry.serving_departures("sglang") == ()
    assert type(registry.create("sglang-radix", cfg).tree) is RadixCache
    assert registry.serving_departures("sglang-radix") == (
        "tree RadixCache (SGLang serves with UnifiedRadixCache)",)
    assert registry.serving_departures("sglang-lfu") == (
        "--radix-eviction-policy lfu (default lru)",)
    assert len(registry.serving_departures("sglang-radix-lfu")) == 2  # the tree and the policy
    assert registry.serving_departures("numpy") is None  # no engine's


@pytest.mark.parametrize("name, policy", [("sglang-lfu", "lfu"), ("sglang-slru", "slru"),
                                          ("sglang-priority", "priority"), ("sglang-fifo", "fifo"),
                                          ("sglang-mru", "mru")])
def test_each_other_policy_builds_the_unified_tree_with_it_and_checks_a_workload(sglang, name, policy):
    """The non-default policies: the serving tree under another eviction strategy, each naming
    its one departure, each replayed under the checker on a prefix-caching workload."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from kvbench.contract import registry
    trace = load_traces([next(p for p in ONE_GROUP if p.stem == "prefix-reuse")])[0]
    backend = registry.create(name, config_for(trace, policy=None, prefix_caching=True))
    assert type(backend.tree) is UnifiedRadixCache and backend.radix_policy == policy
    (departure,) = registry.serving_departures(name)
    assert policy in departure
    v = check(trace, backend)
    assert v.valid is True, str(v.divergence)


# --- the adapter under the checker ------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("path", UNHASHED, ids=lambda p: p.stem)
def test_without_prefix_caching_every_unhashed_workload_checks_clean(sglang, path, block_size):
    from impls.engines.sglang_radix import SglangRadix
    trace = load_traces([path])[0]
    cfg = config_for(trace, policy=None, prefix_caching=False, block_size=block_size)
    v = check(trace, SglangRadix(cfg))
    if engine_lifecycle_na(trace, v):
        return
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)


@pytest.mark.parametrize("tree", ["Sglang", "SglangRadix"])
@pytest.mark.parametrize("path", ONE_GROUP, ids=lambda p: p.stem)
def test_with_prefix_caching_every_workload_checks_clean_under_the_declared_rules(sglang, path, tree):
    import impls.engines.sglang_radix as adapters
    trace = load_traces([path])[0]
    v = check(trace, getattr(adapters, tree)(config_for(trace, policy=None, prefix_caching=True)))
    if engine_lifecycle_na(trace, v):  # no chunked prompts or drafts (SPEC §13)
        return
    assert v.valid is True, str(v.divergence)
    assert v.ops == len(trace.ops)


@pytest.mark.parametrize("path", HYBRID, ids=lambda p: p.stem)
def test_a_hybrid_model_is_not_applicable(sglang, path):
    from impls.engines.sglang_radix import SglangRadix
    trace = load_traces([path])[0]
    cfg = config_for(trace, policy=None)
    v = check(trace, SglangRadix(cfg))
    kinds = ", ".join(g.kind for g in cfg.model.kv_groups)
    assert v.valid is None and v.ops == 0
    assert v.not_applicable == (f"sglang-radix does not run KV cache groups or sliding windows "
                                f"(SPEC §8), and model {cfg.model.name} has {kinds}")


def test_an_eviction_policy_is_not_applicable(sglang):
    from impls.engines.sglang_radix import SglangRadix
    trace = load_traces([committed_workloads()[0]])[0]
    v = check(trace, SglangRadix(config_for(trace, policy="lfu")))
    assert v.not_applicable == ("sglang-radix does not implement eviction policy 'lfu' (SPEC §5), "
                                "and the run evicts under it")


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"shared trace not found: {MOONCAKE}")
def test_mooncake_prefix_cache_unbounded_checks_clean(sglang):
    trace = prefix.cache_trace(load_requests(str(MOONCAKE), "mooncake")[:300], 512)
    v = check(trace, radix(block_size=512, num_blocks=20000), gather="none")
    assert v.valid is True, str(v.divergence)
    assert v.final_ledger["prefix_hit_blocks"] > 0


# --- SGLang's rules, hand-worked --------------------------------------------------------------

@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("tree", ["lru", "serving"])
def test_the_tree_identity_holds_after_every_operation(sglang, block_size, tree):
    trace = load_traces([p for p in committed_workloads() if p.stem == "fork-parallel"])[0]
    be = radix(block_size=block_size, num_blocks=4096, policy=tree)
    for op in trace.ops:
        if isinstance(op, Prefill):
            be.prefill(op.seq, Prompt(op.tokens))
        elif isinstance(op, Append):
            be.append(op.seqs, op.tokens)
        elif isinstance(op, Free):
            be.free(op.seq)
        else:
            be.fork(op.seq, op.src)
        tree_identity(be)
    assert not be.reqs and be.figures()["protected"] == 0  # idle: nothing locked


def test_a_fork_shares_the_full_pages_and_computes_the_tail_again(sglang):
    be = radix()
    be.prefill(0, Prompt(40))  # 3 pages: 40 = 2 * 16 + 8
    be.fork(1, 0)
    assert be.table(1)[:2] == be.table(0)[:2] and be.table(1)[2] != be.table(0)[2]
    assert (be.ledger().blocks_used, be.ledger().shared_blocks) == (4, 2)
    be.fork(2, 1)  # 40 tokens again: 2 full pages found in the tree
    assert be.ledger().shared_blocks == 2 and be.ledger().blocks_used == 5


def test_a_whole_prefix_hit_counts_one_page_less_but_keeps_the_trees_copy(sglang):
    be = radix()
    be.prefill(0, Prompt(32, block_hashes=["a", "b"]))
    be.free(0)
    be.prefill(1, Prompt(32, block_hashes=["a", "b"]))
    led = be.ledger()
    assert led.prefix_hit_blocks == 1  # (32 - 1) // 16: the last token is computed again
    assert (led.blocks_used, led.cached_blocks) == (2, 0)  # its page is the tree's: no duplicate


def test_out_of_memory_is_atomic(sglang):
    be = radix(num_blocks=4)
    be.prefill(0, Prompt(40))
    before = be.ledger().as_dict()
    with pytest.raises(OutOfMemory):  # 3 pages held, 1 free: 33 tokens need 3 pages
        be.prefill(1, Prompt(33))
    assert be.ledger().as_dict() == before


@pytest.mark.parametrize("tree", ["serving", "lru"])
def test_an_allocation_evicts_a_page_per_request_whatever_it_needs(sglang, tree):
    """eviction_demand="page_per_request": SGLang's paged allocation evicts for ``new tokens +
    requests * page_size`` (extend) or ``requests * page_size`` (decode) tokens: "over estimate
    ... assume each request needs a new page". A cached page goes although the free one, or the
    request's own tail, was enough; held to the need, the page stays cached."""
    config = make_config(16, 2, store_kv=False, prefix_caching=True)
    extend = trace_of(Prefill(0, 0, "a", 16, ("p",)), Free(1, 0),  # 1 cached page, 1 free
                      Prefill(2, 1, "a", 8, ()))  # 8 + 16 = 24 tokens > 16 free: "p" goes
    decode = trace_of(Prefill(0, 1, "a", 8, ()), Prefill(1, 0, "a", 16, ("p",)), Free(2, 0),
                      Append(3, (1,), (1,)))  # the 9th token goes in the tail; 16 > 0 free
    for trace, at in ((extend, 2), (decode, 3)):
        assert check(trace, radix(16, 2, policy=tree)).valid is True
        v = check(trace, held_to_spec(radix(16, 2, policy=tree), eviction_demand="need"))
        assert first_divergence(v) == (at, "cached_blocks", 1, 0)  # the rule's 0 = 1 - 1


@pytest.mark.parametrize("tree", ["serving", "lru"])
def test_eviction_takes_a_whole_radix_node(sglang, tree):
    """evicts_whole_leaves: RadixCache.evict frees whole leaves: at page size 1 (exact demand) a
    3-token node goes whole where one token was needed; SPEC's rule evicts that one token."""
    ops = trace_of(Prefill(0, 0, "a", 3, ()), Free(1, 0),  # one node of 3 cached tokens
                   Prefill(2, 1, "a", 2, ()), block_size=1)  # 2 tokens, 1 free: 1 must go
    assert check(ops, radix(1, 4, policy=tree)).valid is True  # cached 0: the node of 3 went
    v = check(ops, held_to_spec(radix(1, 4, policy=tree), evicts_whole_leaves=False))
    if tree == "serving":  # the Rust core exposes no block_state: the count shows it at the eviction
        assert first_divergence(v) == (2, "cached_blocks", 2, 0)  # 2 = 3 - 1
    else:  # RadixCache's order shows it at the free: SPEC's queue takes the tail first, the
        # leaf its 3 pages in position order
        assert first_divergence(v) == (1, "cached blocks (next evicted first)", [2, 1, 0], [0, 1, 2])


@pytest.mark.parametrize("tree", ["serving", "lru"])
def test_lru_evicts_the_least_recently_touched_leaf_not_the_first_released(sglang, tree):
    """leaf_order="lru": a match touches the nodes it walks, a refused admission's too. "a" is
    released before "b", then a refused prompt starting with "a" touches it: the next eviction
    takes "b" (SPEC's rule: "a", the first released), and the last prompt hits "a"."""
    ops = trace_of(Prefill(0, 0, "a", 1, ("a",)), Free(1, 0),
                   Prefill(2, 1, "a", 1, ("b",)), Free(3, 1),  # cached: a, then b
                   Prefill(4, 2, "a", 2, ()),  # the last 2 of the 4 pages: none free
                   Prefill(5, 3, "a", 6, ("a", "x1", "x2", "x3", "x4", "x5")),  # 6 - 1 > 1 (b): refused
                   Prefill(6, 4, "a", 1, ()), Free(7, 4),  # 1 page: one leaf goes
                   Prefill(8, 5, "a", 2, ("a", "z")), block_size=1)  # hits "a" if it stayed
    v = check(ops, radix(1, 4, policy=tree))
    assert v.valid is True and v.final_ledger["prefix_hit_blocks"] == 1, str(v.divergence)
    v = check(ops, held_to_spec(radix(1, 4, policy=tree), evicts_whole_leaves=False))
    if tree == "serving":  # no block_state: its KV events show it at the eviction (step 6)
        d = v.divergence
        assert (d.index, d.quantity) == (6, "residency of group 0, tier 0"), str(d)
        assert (d.expected["removed"], d.actual["removed"]) == (["a"], ["b"])  # SPEC's, SGLang's
    else:  # RadixCache's order shows it at the refused match (step 5): "a" (block 0) touched,
        # "b" (block 1) first; SPEC's queue keeps "a" first
        assert first_divergence(v) == (5, "cached blocks (next evicted first)", [0, 1], [1, 0])


def test_lfu_keeps_the_leaf_found_most(sglang):
    """leaf_order="lfu" (hit count, then last access): "a", found twice, stays and "b" goes; held
    to lru, "a" (last touched before "b") goes and the last prefill hits nothing."""
    ops = trace_of(Prefill(0, 9, "a", 2, ()),  # stays: 2 of the 4 tokens
                   Prefill(1, 0, "a", 1, ("a",)), Free(2, 0), Prefill(3, 2, "a", 1, ("a",)), Free(4, 2),
                   Prefill(5, 1, "a", 1, ("b",)), Free(6, 1),  # "a" released at 4, used twice; "b" at 6
                   Prefill(7, 3, "a", 1, ()), Free(8, 3),  # the pool is full: one of "a", "b" goes
                   Prefill(9, 4, "a", 2, ("a", "z")), block_size=1)
    assert check(ops, radix(1, 4, policy="lfu")).valid is True
    v = check(ops, held_to_spec(radix(1, 4, policy="lfu"), leaf_order="lru"))
    # The order shows it once both are cached (step 6), 3 steps before the hit would: sequence 9
    # holds blocks 0 and 1, "a" is block 2 (found twice), "b" block 3 (once): lru takes "a"
    # first (released at 4, before 6), lfu "b" (1 hit < 2)
    assert first_divergence(v) == (6, "cached blocks (next evicted first)", [2, 3], [3, 2])


@pytest.mark.parametrize("tree", ["serving", "lru"])
def test_a_capped_hit_computes_its_last_page_again(sglang, tree):
    """capped_hit_recomputed: a 2-token prompt all cached hits 1 token ((2 - 1) // 1) and
    allocates a page for the other before its checkpoint shares the tree's copy. With nothing
    free that page is evicted for: the least recently touched leaf, "c" (the match just touched
    "b"). SPEC's rule takes both cached pages, allocates nothing and keeps "c" cached."""
    prefill = trace_of(Prefill(0, 0, "a", 2, ("a", "b")), Free(1, 0),
                       Prefill(2, 2, "a", 1, ("c",)), Free(3, 2),  # 3 cached, none free
                       Prefill(4, 1, "a", 2, ("a", "b")), block_size=1)
    assert check(prefill, radix(1, 3, policy=tree)).valid is True
    v = check(prefill, held_to_spec(radix(1, 3, policy=tree), capped_hit_recomputed=False))
    assert first_divergence(v) == (4, "cached_blocks", 1, 0)  # 1 = 3 - 2 taken
    # A fork of a 6-token parent in 6 pages: 5 = 6 - 1 hit, 1 page to compute, none free.
    fork = trace_of(Prefill(0, 0, "a", 6, ()), Fork(1, 1, 0), block_size=1)
    v = check(fork, radix(1, 6, policy=tree))
    assert v.valid is True and v.ooms == 1  # refused, as the rule says
    v = check(fork, held_to_spec(radix(1, 6, policy=tree), capped_hit_recomputed=False))
    assert first_divergence(v) == (1, "outcome of fork", "success", "out-of-memory")
