"""SGLang's RadixCache and token allocator behind the protocol (impls/engines/sglang_radix.py).

SGLang is opt-in (docs/engines.md's recipe builds /work/sglang-env); CI does not install it, so every
test that needs it is skipped there with the reason (the listing without it is tested in
tests/test_vllm_kvmanager.py). Run them with::

    /work/sglang-env/bin/python -m pytest tests/test_sglang_radix.py

Where SGLang evicts more of its prefix cache than kvbench's rule (the two ways are pinned below
with minimal traces), the checker's first divergence is a cached-block count lower than the
oracle's; results/engines/sglang-radix/README.md explains both.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import engine_lifecycle_na, make_config

from kvbench.analyses import prefix
from kvbench.checking.checker import check
from kvbench.analyses.suite import committed_workloads, config_for, load_traces
from kvbench.contract.protocol import OutOfMemory, Prompt
from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate
from kvbench.traces.loaders import load_requests

SKIP_REASON = "SGLang is not installed (opt-in, not in CI): see docs/engines.md for its recipe"
TRACES = Path(os.environ.get("KVBENCH_TRACES", Path(__file__).resolve().parents[2] / "shared" / "traces"))
MOONCAKE = TRACES / "mooncake" / "synthetic_trace.jsonl"
# RadixCache has no window groups: a workload on a hybrid model (SPEC §8) is n/a, tested apart.
HYBRID = [p for p in committed_workloads() if config_for(load_traces([p])[0], policy=None).model.hybrid]
# Nor lower tiers: a workload with them is n/a (SPEC §11).
ONE_GROUP = [p for p in committed_workloads() if p not in HYBRID and not load_traces([p])[0].header.tiers]
UNHASHED = [p for p in ONE_GROUP if not any(
    getattr(op, "block_hashes", None) for op in load_traces([p])[0].ops)]


@pytest.fixture(scope="module")
def sglang():
    from impls.engines.sglang_radix import NOT_INSTALLED, available
    ok, why = available()  # imports SGLang the adapter's way (see _torchvision_importable)
    if why == NOT_INSTALLED:
        pytest.skip(SKIP_REASON)
    assert ok, why  # installed but broken: say so, never skip


def radix(block_size=16, num_blocks=8, caching=True, policy="lru"):
    from impls.engines.sglang_radix import Sglang, SglangRadix, SglangRadixLFU
    cls = {"lru": SglangRadix, "lfu": SglangRadixLFU, "serving": Sglang}[policy]
    return cls(make_config(block_size=block_size, num_blocks=num_blocks, store_kv=False,
                           prefix_caching=caching))


def trace_of(*ops, block_size=16):
    return validate(Trace(Header(family="test", settings={"block_size": block_size}), list(ops),
                          name="hand"))


def assert_pass_or_over_eviction(v):
    """PASS, or the documented divergence: fewer cached blocks than the oracle keeps."""
    if v.valid:
        return
    d = v.divergence
    assert d.quantity == "cached_blocks" and d.actual < d.expected, str(d)
    assert d.op["op"] in ("prefill", "append", "fork"), str(d)  # calls that allocate


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
    assert_pass_or_over_eviction(check(trace, backend))


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
def test_with_prefix_caching_a_workload_passes_or_over_evicts(sglang, path, tree):
    import impls.engines.sglang_radix as adapters
    trace = load_traces([path])[0]
    v = check(trace, getattr(adapters, tree)(config_for(trace, policy=None, prefix_caching=True)))
    if engine_lifecycle_na(trace, v):  # no chunked prompts or drafts (SPEC §13)
        return
    assert_pass_or_over_eviction(v)


@pytest.mark.parametrize("path", HYBRID, ids=lambda p: p.stem)
def test_a_hybrid_model_is_not_applicable(sglang, path):
    from impls.engines.sglang_radix import SglangRadix
    trace = load_traces([path])[0]
    cfg = config_for(trace, policy=None)
    v = check(trace, SglangRadix(cfg))
    kinds = ", ".join(g.kind for g in cfg.model.kv_groups)
    assert v.valid is None and v.ops == 0
    assert v.not_applicable == (f"sglang-radix does not run KV cache groups or sliding windows, "
                                f"and model {cfg.model.name} has {kinds}")


def test_an_eviction_policy_is_not_applicable(sglang):
    from impls.engines.sglang_radix import SglangRadix
    trace = load_traces([committed_workloads()[0]])[0]
    v = check(trace, SglangRadix(config_for(trace, policy="lfu")))
    assert v.not_applicable == "sglang-radix does not implement eviction policy 'lfu'"


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


def test_an_allocation_evicts_a_page_per_request_whatever_it_needs(sglang):
    """SGLang's paged allocation evicts for ``new tokens + requests * page_size`` (extend) or
    ``requests * page_size`` (decode) tokens: "over estimate ... assume each request needs a new
    page". A cached page goes although the free one, or the request's own tail, was enough."""
    from impls.engines.sglang_radix import SglangRadix
    config = make_config(16, 2, store_kv=False, prefix_caching=True)
    extend = [Prefill(0, 0, "a", 16, ("p",)), Free(1, 0),  # 1 cached page, 1 free
              Prefill(2, 1, "a", 8, ())]  # 8 tokens: the free page; SGLang evicts for 8 + 16
    d = check(trace_of(*extend), SglangRadix(config)).divergence
    assert (d.index, d.quantity, d.expected, d.actual) == (2, "cached_blocks", 1, 0)
    decode = [Prefill(0, 1, "a", 8, ()), Prefill(1, 0, "a", 16, ("p",)), Free(2, 0),
              Append(3, (1,), (1,))]  # the 9th token goes in the tail; SGLang evicts for 16
    d = check(trace_of(*decode), SglangRadix(config)).divergence
    assert (d.index, d.quantity, d.expected, d.actual) == (3, "cached_blocks", 1, 0)


def test_eviction_takes_a_whole_radix_node(sglang):
    """RadixCache.evict frees whole leaves: at page size 1 (exact demand) a 3-token node goes
    whole where one token was needed."""
    from impls.engines.sglang_radix import SglangRadix
    ops = [Prefill(0, 0, "a", 3, ()), Free(1, 0),  # one node of 3 cached tokens
           Prefill(2, 1, "a", 2, ())]  # 2 tokens: 1 free, so 1 cached token must go
    v = check(trace_of(*ops, block_size=1),
              SglangRadix(make_config(1, 4, store_kv=False, prefix_caching=True)))
    d = v.divergence
    assert (d.index, d.quantity, d.expected, d.actual) == (2, "cached_blocks", 2, 0)  # 2 = 3 - 1


@pytest.mark.parametrize("policy, valid", [("lru", True), ("lfu", False)])
def test_the_lru_radix_policy_is_kvbenchs_order_and_lfu_is_its_own(sglang, policy, valid):
    """kvbench evicts the least recently released cached block; SGLang's lru evicts the least
    recently touched leaf, and a release touches its whole path (the insert at free), so the two
    agree. lfu keeps "a", found twice, and evicts "b": the last prefill then finds "a"."""
    from impls.engines.sglang_radix import SglangRadix, SglangRadixLFU
    ops = [Prefill(0, 9, "a", 2, ()),  # stays: 2 of the 4 tokens
           Prefill(1, 0, "a", 1, ("a",)), Free(2, 0), Prefill(3, 2, "a", 1, ("a",)), Free(4, 2),
           Prefill(5, 1, "a", 1, ("b",)), Free(6, 1),  # "a" released at 4, used twice; "b" at 6
           Prefill(7, 3, "a", 1, ()), Free(8, 3),  # the pool is full: one of "a", "b" goes
           Prefill(9, 4, "a", 2, ("a", "z"))]
    cls = {"lru": SglangRadix, "lfu": SglangRadixLFU}[policy]
    v = check(trace_of(*ops, block_size=1), cls(make_config(1, 4, store_kv=False, prefix_caching=True)))
    assert v.valid is valid, str(v.divergence)
    if not valid:
        d = v.divergence
        assert (d.index, d.quantity, d.expected, d.actual) == (9, "prefix_hit_blocks", 0, 1)
